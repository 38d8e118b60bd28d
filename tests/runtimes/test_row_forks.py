"""Rows of the memory selected, forked and reordered (`TxlRuntime.select_rows`, `copy_rows`) on every CPU backend:
a forked row continues exactly as its source would, alone; a reorder moves whole streams; writing one copy never
changes another; a bad row list is refused and leaves the memory as it was.

Tolerance: the same backend computes both sides, so a forked stream matches the lone stream to 1e-5 (batch rows
may take other kernels than a lone row; observed ~1e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.streams import assert_state_equal

from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.saved_state import LAST_LOG_PROBS

TOL = 1e-5
BACKENDS = ["onnxruntime", "torch", "torch-fast", "executorch"]


@pytest.fixture(scope="module", params=BACKENDS)
def rt(request, tiny_ckpt, tiny_onnx):
    if request.param == "executorch":
        pytest.importorskip("executorch", reason="pip install 'txl-deploy[executorch]'")
        path = request.getfixturevalue("tiny_pte")
    else:
        path = tiny_onnx if request.param == "onnxruntime" else tiny_ckpt
    with TxlRuntime.load(path, backend=None if request.param in ("onnxruntime", "executorch") else request.param) as r:
        yield r


def _alone(rt, prefix, continuation):
    rt.reset()
    rt.step(prefix)
    return rt.step(continuation)


def test_a_forked_prefix_continues_as_each_stream_alone(rt):
    """The prefix is read once (wrapping the 12-slot memory), forked into three rows, each fed its own text."""
    gen = np.random.default_rng(0)
    prefix = gen.integers(0, rt.n_token, (1, 17))
    conts = gen.integers(0, rt.n_token, (3, 9))
    want = np.concatenate([_alone(rt, prefix, conts[i:i + 1]) for i in range(3)])
    rt.reset()
    last = rt.step(prefix)[:, -1]
    rt.select_rows([0, 0, 0])
    assert rt.batch_size == 3
    np.testing.assert_array_equal(rt.save_state()[LAST_LOG_PROBS], np.repeat(last, 3, axis=0))
    np.testing.assert_allclose(rt.step(conts), want, atol=TOL, rtol=0)


def test_a_reorder_moves_whole_streams_and_copies_stay_independent(rt):
    gen = np.random.default_rng(1)
    a, b = gen.integers(0, rt.n_token, (2, 1, 14))
    nxt = gen.integers(0, rt.n_token, (2, 5))
    want_a, want_b = _alone(rt, a, nxt[1:]), _alone(rt, b, nxt[:1])
    rt.reset()
    rt.step(np.concatenate([a, b]))
    rt.select_rows([1, 0])  # swap, in place
    got = rt.step(nxt)
    np.testing.assert_allclose(got[0], want_b[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(got[1], want_a[0], atol=TOL, rtol=0)
    # row 1 copied into row 0: both then hold b's stream; feeding them differently never mixes them
    rt.reset()
    rt.step(np.concatenate([a, b]))
    rt.copy_rows([1], [0])
    after = rt.step(nxt)
    np.testing.assert_allclose(after[1], _alone(rt, b, nxt[1:])[0], atol=TOL, rtol=0)
    np.testing.assert_allclose(after[0], want_b[0], atol=TOL, rtol=0)


@pytest.mark.parametrize("call, match", [
    (lambda rt: rt.select_rows([0, 2]), "row 2 is outside the batch"),
    (lambda rt: rt.select_rows([]), "at least one row"),
    (lambda rt: rt.copy_rows([0, 1], [1, 1]), "each dst row named once"),
    (lambda rt: rt.copy_rows([-1], [0]), "row -1 is outside"),
    (lambda rt: rt.select_rows([[0]]), "list of row indices"),
])
def test_a_bad_row_list_is_refused_and_leaves_the_memory(rt, call, match):
    rt.reset()
    rt.step(np.arange(10).reshape(2, 5) % rt.n_token)
    before = rt.save_state()
    with pytest.raises(InputError, match=match):
        call(rt)
    assert_state_equal(rt.save_state(), before)
