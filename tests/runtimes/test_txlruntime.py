"""TxlRuntime on the tiny model: segments fed in pieces, generation, scoring, its state (rows reset alone, saved and
loaded, a foreign state refused), bad input refused with the memory untouched, concurrent use from threads, and no
torch on the ONNX Runtime path.

Tolerance: fp32 log-probabilities within 1e-4 max abs difference of the eager reference (observed ~2e-6).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from helpers.streams import assert_reset_rows_restarts_only_those_rows, assert_state_equal, one_pass
from helpers.tiny import TINY_VOCAB, make_tiny_model

from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.runtimes import TxlRuntime

TOL = 1e-4


# -- feeding --------------------------------------------------------------------------------------------------
def test_prompt_into_an_empty_memory_uses_one_slot_and_matches(ort_rt, ref_rt):
    """Streams that have consumed nothing are fed a 1-slot memory (no scores against mem_len masked slots)."""
    seen = []
    run = ort_rt.backend.session.run

    def spy(names, feeds):
        seen.append(feeds["mem_k.0"].shape[-1])
        return run(names, feeds)

    tokens = np.random.default_rng(9).integers(0, 60, (2, 30))
    ort_rt.backend.session.run = spy
    try:
        got = one_pass(ort_rt, tokens)
    finally:
        del ort_rt.backend.session.run
    assert seen == [1, 12]  # the first piece (16 tokens) from an empty memory, then the 12-slot ring
    np.testing.assert_allclose(got, one_pass(ref_rt, tokens), atol=TOL, rtol=0)


def test_torch_fast_path_matches_reference(tiny_ckpt, ref_rt):
    fast = TxlRuntime.load(tiny_ckpt, backend="torch-fast", max_segment=16)
    tokens = np.random.default_rng(2).integers(0, 60, (2, 40))
    ref_rt.reset()
    for a in range(0, 40, 7):
        np.testing.assert_allclose(fast.step(tokens[:, a:a + 7]), ref_rt.step(tokens[:, a:a + 7]), atol=TOL, rtol=0)
    ref_rt.reset()


def test_segments_longer_than_max_segment_are_fed_in_pieces(ort_rt, ref_rt):
    tokens = np.random.default_rng(3).integers(0, 60, (2, 40))  # max_segment is 16
    np.testing.assert_allclose(one_pass(ort_rt, tokens), one_pass(ref_rt, tokens), atol=TOL, rtol=0)


# -- generation -----------------------------------------------------------------------------------------------
def test_greedy_200_tokens_identical(ort_rt, ref_rt):
    ref_rt.reset()
    ort_rt.reset()
    ref = list(ref_rt.generate("w1 w2 w3", max_new_tokens=200, temperature=0))
    got = list(ort_rt.generate("w1 w2 w3", max_new_tokens=200, temperature=0))
    assert len(got) == 200 and got == ref
    ref_rt.reset()
    ort_rt.reset()


def test_seeded_sampling_is_reproducible(ort_rt):
    runs = []
    for _ in range(2):
        ort_rt.reset()
        runs.append(list(ort_rt.generate("w5", max_new_tokens=40, temperature=1.0, top_k=20, top_p=0.9, seed=7)))
    ort_rt.reset()
    other = list(ort_rt.generate("w5", max_new_tokens=40, temperature=1.0, top_k=20, top_p=0.9, seed=8))
    ort_rt.reset()
    assert runs[0] == runs[1] and runs[0] != other


def test_prefill_asks_only_for_the_last_position(ort_rt):
    seen = []
    run = ort_rt.backend.run

    def spy(state, tokens, out_positions):
        seen.append(out_positions.shape)
        return run(state, tokens, out_positions)

    ort_rt.backend.run = spy
    try:
        ort_rt.reset()
        lp = ort_rt.prefill(np.arange(40).reshape(1, 40) % 60)
    finally:
        del ort_rt.backend.run
        ort_rt.reset()
    assert lp.shape == (1, 60)
    assert seen == [(1, 1)] * 3  # three segments of <= 16 tokens, each returning one position


def test_score_matches_step(ort_rt):
    tokens = np.random.default_rng(4).integers(0, 60, (2, 30))
    ort_rt.reset()
    nll = ort_rt.score(tokens)
    ort_rt.reset()
    lp = ort_rt.step(tokens)
    ort_rt.reset()
    expect = -np.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    np.testing.assert_allclose(nll, expect, atol=1e-5)


# -- state ----------------------------------------------------------------------------------------------------
def test_reset_rows_restarts_only_those_rows(ort_rt, ref_rt):
    for rt in (ort_rt, ref_rt):
        assert_reset_rows_restarts_only_those_rows(rt, seed=5, atol=TOL)


def test_save_and_load_state_resumes_a_conversation(ort_rt, tmp_path):
    tokens = np.random.default_rng(6).integers(0, 60, (1, 30))
    ort_rt.reset()
    ort_rt.step(tokens[:, :20])
    saved = ort_rt.save_state(tmp_path / "conv.npz")
    expect = ort_rt.step(tokens[:, 20:])
    ort_rt.reset()
    ort_rt.step(tokens[:, :5])  # something else in between
    ort_rt.load_state(tmp_path / "conv.npz")
    np.testing.assert_array_equal(ort_rt.step(tokens[:, 20:]), expect)
    ort_rt.load_state(saved)
    np.testing.assert_array_equal(ort_rt.step(tokens[:, 20:]), expect)
    ort_rt.reset()


def test_state_from_another_model_is_refused(ort_rt, ref_rt, tmp_path):
    from txl_deploy.exporters.onnx.export import export_onnx

    other = export_onnx(_other_ckpt(tmp_path), tmp_path / "other.onnx", max_segment=16,
                        verify=False).path
    rt2 = TxlRuntime.load(other)
    rt2.step([[1, 2, 3]])
    foreign = rt2.save_state()
    ort_rt.reset()
    ort_rt.step([[4, 5]])
    before = ort_rt.save_state()
    with pytest.raises(InputError, match="another model"):
        ort_rt.load_state(foreign)
    ref_rt.reset()
    ref_rt.step([[1]])
    with pytest.raises(InputError, match="another model"):
        ort_rt.load_state(ref_rt.save_state())  # hidden-state memory of the eager reference
    ref_rt.reset()
    assert_state_equal(ort_rt.save_state(), before)
    ort_rt.reset()


def _other_ckpt(tmp_path):
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    return save_checkpoint(tmp_path / "other", make_tiny_model(seed=1), Vocab(TINY_VOCAB))


# -- bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens, message", [
    ([[1, 2, 60]], "token id 60 is outside the vocabulary"),
    ([[-1, 2]], "token id -1 is outside the vocabulary"),
    ([1, 2, 3], "rank 1"),
    ([[[1, 2]]], "rank 3"),
    (np.array([[1.0, 2.0]]), "must be integers"),
    ([[1, 2], [3, 4], [5, 6]], "batch size 3 does not match"),
])
def test_bad_tokens_are_rejected_and_the_memory_is_untouched(ort_rt, ref_rt, tokens, message):
    for rt in (ort_rt, ref_rt):
        rt.reset()
        rt.step([[1, 2], [3, 4]])
        before = rt.save_state()
        with pytest.raises(InputError, match=message):
            rt.step(tokens)
        assert_state_equal(rt.save_state(), before)
        rt.reset()


def test_onnx_not_from_txl_deploy_is_refused(tmp_path):
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), tmp_path / "foreign.onnx")
    with pytest.raises(CheckpointError, match="not exported by txl-deploy"):
        TxlRuntime.load(tmp_path / "foreign.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00\x01 this is not onnx")
    with pytest.raises(CheckpointError, match="junk.onnx"):
        TxlRuntime.load(tmp_path / "junk.onnx")


def test_concurrent_use_from_threads_does_not_corrupt_the_memory(tiny_onnx):
    """A runtime may be shared across threads: calls are serialised by its lock."""
    rt = TxlRuntime.load(tiny_onnx)
    rt.step([[0, 1]])
    tokens = [[7]]
    n_threads, per_thread = 4, 10
    barrier = threading.Barrier(n_threads)

    def worker():
        barrier.wait()
        for _ in range(per_thread):
            rt.step(tokens)

    threads = [threading.Thread(target=worker) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # same result as the same 40 steps run one after another
    seq = TxlRuntime.load(tiny_onnx)
    seq.step([[0, 1]])
    for _ in range(n_threads * per_thread):
        seq.step(tokens)
    assert_state_equal(rt.save_state(), seq.save_state())


# -- no torch on the runtime path -----------------------------------------------------------------------------
def test_onnxruntime_backend_runs_without_torch(tiny_onnx):
    code = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError("torch is blocked in this test")
        sys.meta_path.insert(0, Block())
        import txl_deploy
        from txl_deploy import TxlRuntime
        rt = TxlRuntime.load({str(tiny_onnx)!r})
        toks = list(rt.generate("w1 w2", max_new_tokens=5, temperature=0))
        assert len(toks) == 5
        assert "torch" not in sys.modules
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_a_prompt_hands_its_temporaries_back_and_a_decode_step_does_not(tiny_onnx, monkeypatch):
    """A prompt's working set (a 512-position chunk's activations) is freed into the heap, which would keep it for
    good: the ONNX Runtime backend returns it to the system after every multi-token segment, never after a decode
    step (benchmarks/peak_ram.py measures what that keeps resident)."""
    from txl_deploy.runtimes.backends import onnxruntime as ort_backend

    trims = []
    with TxlRuntime.load(tiny_onnx) as rt:
        monkeypatch.setattr(ort_backend, "return_free_memory", lambda: trims.append(1))
        tokens = np.random.default_rng(0).integers(0, rt.n_token, size=(1, 40))
        rt.prefill(tokens[:, :20])  # two segments of at most 16
        assert len(trims) == 2
        rt.step(tokens[:, 20:21])
        list(rt.generate(tokens[0, 21:24], max_new_tokens=3, temperature=0))  # a 3-token prompt, then decode
        assert len(trims) == 3
