"""Lazy decoding: the head first, only the tails a sampler asks for (runtimes/lazy_decode.py), on the ONNX Runtime
backend (the exported parts) and the PyTorch reference."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from txl_deploy.errors import CheckpointError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.lazy_decode import decide, full_log_probs
from txl_deploy.runtimes.sampling import Clusters, Sampler, SamplingParams

PROMPT = [1, 5, 12, 40, 3]
SETTINGS = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=0.8, top_k=20, seed=1)]


@pytest.fixture(params=["onnxruntime", "torch"])
def rt(request, tiny_onnx, tiny_ckpt):
    with TxlRuntime.load(tiny_onnx if request.param == "onnxruntime" else tiny_ckpt) as runtime:
        assert runtime.backend.clusters is not None
        yield runtime


def _full_path(rt, **kw):
    """generate with the parts switched off: full distributions every step."""
    clusters, rt.backend.clusters = rt.backend.clusters, None
    try:
        rt.reset()
        return list(rt.generate(PROMPT, max_new_tokens=30, **kw))
    finally:
        rt.backend.clusters = clusters


@pytest.mark.parametrize("kw", SETTINGS, ids=["greedy", "seed3", "top_k"])
def test_lazy_generate_gives_the_full_paths_tokens(rt, kw):
    rt.reset()
    before = rt.tail_stats["decisions"]
    lazy = list(rt.generate(PROMPT, max_new_tokens=30, **kw))
    assert lazy == _full_path(rt, **kw)
    assert rt.tail_stats["decisions"] - before == 30


def test_head_and_tails_equal_run(rt):
    """run_head advances the memory as run does, and the head with every tail is run's distribution."""
    rt.reset()
    b = rt.backend
    s_full, s_head = b.new_state(2), b.new_state(2)
    rng = np.random.default_rng(0)
    for q in (4, 1, 1, 7):
        tokens = rng.integers(0, rt.n_token, (2, q))
        pos = np.tile(np.arange(q), (2, 1))
        want = b.run(s_full, tokens, pos)
        hidden, head = b.run_head(s_head, tokens, pos)
        assert hidden.shape == (2, q, rt.config.d_model)
        got = full_log_probs(b, hidden.reshape(2 * q, -1), head.reshape(2 * q, -1)).reshape(want.shape)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_decide_batches_each_needed_cluster_once_per_round(rt):
    b = rt.backend
    rt.reset()
    state = b.new_state(4)
    tokens = np.array([[1, 2], [3, 4], [5, 6], [7, 8]])
    hidden, head = b.run_head(state, tokens, np.ones((4, 1), np.int64))
    clusters = Clusters.of(rt.config)
    samplers = [Sampler(SamplingParams(temperature=1.0, seed=r), rt.n_token, clusters=clusters) for r in range(3)]
    twins = [Sampler(SamplingParams(temperature=1.0, seed=r), rt.n_token, clusters=clusters) for r in range(3)]
    d = decide(b, samplers + [None], hidden[:, 0], head[:, 0])
    full = full_log_probs(b, hidden[:, 0], head[:, 0])
    assert d.tokens[3] == -1 and d.choices[3] is None
    assert list(d.tokens[:3]) == [t.choose(full[r]) for r, t in enumerate(twins)]
    assert (d.tail_calls <= d.tail_rows).all() and d.tail_rows.sum() == sum(len(c.revealed) for c in d.choices[:3])


def _copy(tiny_onnx, folder):
    for f in tiny_onnx.parent.glob("tiny*.onnx"):
        shutil.copy(f, folder / f.name)
    return folder / "tiny.onnx"


@pytest.mark.parametrize("damage", ["tampered", "missing", "foreign"])
def test_refused_parts_leave_the_full_path(tiny_onnx, tmp_path, damage, caplog):
    model = _copy(tiny_onnx, tmp_path)
    tail = tmp_path / "tiny.tail1.onnx"
    if damage == "tampered":
        data = bytearray(tail.read_bytes())
        data[len(data) // 2] ^= 0xFF
        tail.write_bytes(bytes(data))
    elif damage == "missing":
        tail.unlink()
    else:  # another cluster's graph under this one's name
        shutil.copy(tmp_path / "tiny.tail2.onnx", tail)
    with TxlRuntime.load(model) as rt:
        assert rt.backend.clusters is None
        assert "tiny.tail1.onnx" in caplog.text
        with pytest.raises(CheckpointError) as e:
            rt.backend.run_head(rt.backend.new_state(1), np.array([[1]]), np.zeros((1, 1), np.int64))
        assert "\n" not in str(e.value)
        got = list(rt.generate(PROMPT, max_new_tokens=10, temperature=0))
    with TxlRuntime.load(tiny_onnx) as good:
        assert got == list(good.generate(PROMPT, max_new_tokens=10, temperature=0))


def test_generate_continues_after_a_lazy_generate(tiny_onnx):
    with TxlRuntime.load(tiny_onnx) as rt:
        first = list(rt.generate(PROMPT, max_new_tokens=5, temperature=0))
        more = list(rt.generate(None, max_new_tokens=5, temperature=0))
        lazy_last = rt.step([[more[-1]]])[0, -1]
    with TxlRuntime.load(tiny_onnx) as ref:
        ref.backend.clusters = None
        assert first + more == list(ref.generate(PROMPT, max_new_tokens=10, temperature=0))
        np.testing.assert_allclose(lazy_last, ref.step([[more[-1]]])[0, -1], atol=1e-5)
