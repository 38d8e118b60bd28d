"""The Python-backend model's batched memory (RowPool), without a server: any subset of conversations, any mix of
segment lengths and out_positions, run as batched calls over the rows of one state, gives every conversation
exactly what it gets alone in a TxlRuntime -- including the rows a call computes only to fill a hole and puts back.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

MODEL_PY = Path(__file__).resolve().parents[1] / "exporters" / "triton_python_model.py"


@pytest.fixture(scope="module")
def model_module():
    # model.py imports Triton's stub module at import time; these tests use only its RowPool.
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
    try:
        spec = importlib.util.spec_from_file_location("txl_triton_model_under_test", MODEL_PY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved
        sys.unraisablehook = sys.__unraisablehook__


def test_spans_merge_runs_across_small_gaps_only(model_module):
    pool = model_module.RowPool.__new__(model_module.RowPool)
    spans = lambda rows: [(lo, hi) for lo, hi, _ in pool.spans(np.array(rows))]  # noqa: E731
    assert spans([0, 1, 2, 3]) == [(0, 4)]
    assert spans([0, 1, 3, 4]) == [(0, 5)]  # one hole among four members
    assert spans([0, 9]) == [(0, 1), (9, 10)]  # eight holes for two members: two calls instead
    assert spans([2, 3, 4, 5, 7, 15]) == [(2, 8), (15, 16)]
    members = pool.spans(np.array([0, 2, 3, 8]))
    assert [m for _, _, m in members] == [[0, 1, 2], [3]]


@pytest.mark.parametrize("layout", ["incremental", "full"])
def test_batched_rows_match_each_conversation_alone(model_module, tiny_onnx, tiny_onnx_full, layout):
    from txl_deploy.runtimes import TxlRuntime

    path = tiny_onnx if layout == "incremental" else tiny_onnx_full
    shared = TxlRuntime.load(path)
    pool = model_module.RowPool(shared.backend, 8)
    rng = np.random.default_rng(3)
    rows = [pool.start() for _ in range(8)]
    assert rows == list(range(8))  # lowest first
    alone = [TxlRuntime.load(path) for _ in rows]
    # steps of random subsets (holes inside spans, separate spans), the same segment length within a call,
    # different out_positions per row; more than mem_len (12) tokens in all, so the ring wraps
    for step in range(14):
        chosen = np.sort(rng.choice(8, size=int(rng.integers(1, 9)), replace=False))
        q = int(rng.integers(1, 4))
        tokens = rng.integers(0, 60, size=(chosen.size, q))
        positions = np.stack([np.sort(rng.integers(0, q, size=2)) for _ in chosen])
        got = pool.run(chosen, tokens, positions)
        for j, r in enumerate(chosen):
            want = alone[r].step(tokens[j:j + 1])[0, positions[j]]
            np.testing.assert_allclose(got[j], want, rtol=0, atol=1e-5, err_msg=f"step {step} row {r}")
    # every memory, including the rows that were holes, is exactly each conversation's own
    for r, rt in enumerate(alone):
        mine = pool.save(r)
        theirs = rt.save_state()
        for name, value in mine.items():
            np.testing.assert_allclose(value, theirs[name], rtol=0, atol=1e-5, err_msg=name)
    assert pool.with_holes > 0 and pool.viewed > 0
    # an ended conversation's row is handed out again, empty
    pool.release(3)
    assert pool.start() == 3 and int(pool.state["mem_count"][3]) == 0
