"""The Python-backend model's batched memory (RowPool), without a server: any subset of conversations, any mix of
segment lengths and out_positions, run as batched calls over the rows of one state, gives every conversation
exactly what it gets alone in a TxlRuntime -- including the rows a call computes only to fill a hole and puts back.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.triton_stub import Request, load_model_module, start_model


@pytest.fixture(scope="module")
def model_module():
    # model.py imports Triton's stub module at import time: a stand-in over numpy (the server tests run the real one)
    return load_model_module()


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


def test_a_call_that_fails_part_way_says_which_rows_advanced(model_module, tiny_onnx, monkeypatch):
    """Rows 0-1 and 10-11 are two spans, so two backend calls: when the second fails, the first's rows have
    advanced and the others are as they were, and the error says which; a failure of the first call commits
    nothing and is the backend's own. Rows are handed out once each, within the pool."""
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.serving.rows import PartialRun, RowsExhausted

    shared = TxlRuntime.load(tiny_onnx)
    pool = model_module.RowPool(shared.backend, 12)
    rows = [pool.start() for _ in range(12)]
    with pytest.raises(RowsExhausted):
        pool.start()
    run, calls = shared.backend.run, []

    def fails_at(n):
        def run_or_fail(*args):
            calls.append(n)
            if len(calls) == n:
                raise RuntimeError("the device went away")
            return run(*args)
        return run_or_fail

    chosen = np.array([0, 1, 10, 11])
    tokens, positions = np.array([[3], [4], [5], [6]]), np.zeros((4, 1), dtype=np.int64)
    before = {r: pool.save(r) for r in rows}
    monkeypatch.setattr(shared.backend, "run", fails_at(2))
    with pytest.raises(PartialRun) as e:
        pool.run(chosen, tokens, positions)
    assert e.value.committed == [0, 1] and isinstance(e.value.__cause__, RuntimeError)
    count = pool.state["mem_count"]
    assert [int(count[r]) for r in (0, 1, 10, 11)] == [1, 1, 0, 0]
    for r in (10, 11):
        for name, value in pool.save(r).items():
            np.testing.assert_array_equal(value, before[r][name], err_msg=name)
    calls.clear()
    monkeypatch.setattr(shared.backend, "run", fails_at(1))
    with pytest.raises(RuntimeError, match="went away"):
        pool.run(chosen, tokens, positions)
    assert [int(count[r]) for r in (0, 1, 10, 11)] == [1, 1, 0, 0]
    for r in rows:
        pool.release(r)
    with pytest.raises(ValueError, match="not in use"):
        pool.release(rows[0])
    assert pool.accounted() and len(pool.free) == 12


def test_one_execute_serves_mixed_segment_lengths_positions_and_a_bad_request(model_module, tiny_onnx, tmp_path):
    """A batch as the sequence batcher hands it over: different segment lengths (separate calls), different
    out_positions (padded), a conversation starting from a parked state, and a bad request that gets its own error."""
    from txl_deploy.runtimes import TxlRuntime

    model = start_model(model_module, tiny_onnx, tmp_path / "repo", max_batch=8, max_sequences=8)
    prompts = {1: [5, 17, 42], 2: [3, 9], 3: [1, 2, 3, 4, 5], 4: [7]}
    alone = {c: TxlRuntime.load(tiny_onnx) for c in prompts}
    first = model.execute([Request(c, p, [len(p) - 1], start=True) for c, p in prompts.items()])
    for c, p in prompts.items():
        want = alone[c].step(np.array([p]))[0, -1]
        np.testing.assert_allclose(first[list(prompts).index(c)].outputs["log_probs"][0, 0], want, atol=1e-5)
    # park conversation 4, then one batch: Q = 2 with one and with three positions, Q = 1, a resumed conversation
    # (5, from 4's state), and a token outside the vocabulary
    parked = model.execute([Request(4, [], [], end=True, want_state=True)])[0]
    state = parked.outputs["saved_state"]
    batch = [Request(1, [8, 9], [1]), Request(2, [10, 11], [0, 1, 1]), Request(3, [12], [0]),
             Request(5, [13], [0], start=True, resume=state), Request(4, [1], [0]), Request(2, [60], [0])]
    out = model.execute(batch)
    assert out[4].error is not None and "unknown" in out[4].error  # 4 was parked: ended here
    np.testing.assert_allclose(out[0].outputs["log_probs"][0], alone[1].step(np.array([[8, 9]]))[0, [1]], atol=1e-5)
    np.testing.assert_allclose(out[1].outputs["log_probs"][0], alone[2].step(np.array([[10, 11]]))[0, [0, 1, 1]],
                               atol=1e-5)
    np.testing.assert_allclose(out[2].outputs["log_probs"][0], alone[3].step(np.array([[12]]))[0], atol=1e-5)
    np.testing.assert_allclose(out[3].outputs["log_probs"][0], alone[4].step(np.array([[13]]))[0], atol=1e-5)
    # conversation 2 appeared twice: its second (bad) request ran after the first and changed nothing
    assert out[5].error is not None and "outside the vocabulary" in out[5].error
    again = model.execute([Request(2, [14], [0])])[0]
    np.testing.assert_allclose(again.outputs["log_probs"][0], alone[2].step(np.array([[14]]))[0], atol=1e-5)
    model.finalize()
