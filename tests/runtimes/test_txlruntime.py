"""ONNX export and TxlRuntime: parity with the PyTorch reference, generation, state handling and bad input.

Tolerance: fp32 log-probabilities within 1e-4 max abs difference of the eager reference (observed ~2e-6).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl_deploy.cli import main
from txl_deploy.errors import CheckpointError, InputError, OutputExistsError
from txl_deploy.runtimes import TxlRuntime

TOL = 1e-4


@pytest.fixture(scope="module")
def ort_rt(tiny_onnx):
    return TxlRuntime.load(tiny_onnx)


@pytest.fixture(scope="module")
def ref_rt(tiny_ckpt):
    return TxlRuntime.load(tiny_ckpt)


def _one_pass(rt, tokens):
    rt.reset()
    out = rt.step(tokens)
    rt.reset()
    return out


def _split_pass(rt, tokens, cuts):
    rt.reset()
    bounds = [0] + sorted(cuts) + [tokens.shape[1]]
    out = np.concatenate([rt.step(tokens[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], axis=1)
    rt.reset()
    return out


# -- the graph itself ---------------------------------------------------------------------------------------------
def test_graph_is_static_and_self_describing(tiny_onnx):
    import onnx

    from txl_deploy.contract.metadata import read_onnx_info
    from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat

    model = onnx.load(str(tiny_onnx))
    assert check_tensorrt_compat(model).ok
    ops = {n.op_type for n in model.graph.node}
    assert not ops & {"If", "Loop", "NonZero", "Scan"}
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 17
    info = read_onnx_info(tiny_onnx)
    assert info.mem_len == 12 and info.state == "incremental" and info.vocab is not None
    assert info.verification["passed"] and info.verification["max_abs_diff"] <= TOL
    names = [i.name for i in model.graph.input]
    assert names[:3] == ["tokens", "out_positions", "mem_k.0"] and names[-1] == "mem_count"
    # state tensors: batch-first, no zero-size dimension; besides the batch only the slot axis of an incremental
    # graph is dynamic (a 1-slot memory for empty streams); a full-state graph is static apart from the batch
    for vi in model.graph.input[2:]:
        dims = vi.type.tensor_type.shape.dim
        assert dims[0].dim_param
        fixed = [d.dim_value for d in dims[1:] if not d.dim_param]
        assert all(v > 0 for v in fixed) and len(fixed) >= len(dims) - 2
        if vi.name.startswith(("mem_k.", "mem_v.")):
            slot_axis = 3 if vi.name.startswith("mem_k") else 2
            assert dims[slot_axis].dim_param == "slots"


def test_full_state_graph_is_static_apart_from_the_batch(tiny_onnx_full):
    import onnx

    model = onnx.load(str(tiny_onnx_full))
    for vi in list(model.graph.input)[2:] + list(model.graph.output)[1:]:
        dims = vi.type.tensor_type.shape.dim
        assert dims[0].dim_param and all(d.dim_value > 0 for d in dims[1:]), vi.name


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
        got = _one_pass(ort_rt, tokens)
    finally:
        del ort_rt.backend.session.run
    assert seen == [1, 12]  # the first piece (16 tokens) from an empty memory, then the 12-slot ring
    np.testing.assert_allclose(got, _one_pass(ref_rt, tokens), atol=TOL, rtol=0)


def test_export_longer_memory_than_training(tiny_ckpt, tmp_path):
    from txl_deploy.exporters.onnx.export import export_onnx

    res = export_onnx(tiny_ckpt, tmp_path / "long.onnx", mem_len=40, max_segment=16)
    assert res.info.mem_len == 40 and res.verification["passed"]


# -- parity ---------------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_split_equals_one_pass(ort_rt, ref_rt, data):
    """A stream no longer than mem_len gives the same log-probs however it is cut into segments (both backends)."""
    length = data.draw(st.integers(2, 12), label="length")
    batch = data.draw(st.integers(1, 3), label="batch")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    cuts = data.draw(st.lists(st.integers(1, length - 1), max_size=5, unique=True), label="cuts")
    tokens = np.random.default_rng(seed).integers(0, 60, (batch, length))
    ref_whole = _one_pass(ref_rt, tokens)
    for rt in (ref_rt, ort_rt):
        np.testing.assert_allclose(_split_pass(rt, tokens, cuts), ref_whole, atol=TOL, rtol=0)


def test_long_stream_matches_reference_with_wrapping_ring(ort_rt, ref_rt, tiny_onnx_full):
    """Past mem_len the memory is truncated: the ring buffers must drop exactly the tokens the paper's memory drops."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 60, (3, 80))
    segments = [5, 1, 1, 16, 3, 1, 1, 1, 13, 16, 2, 1, 1, 8, 1]
    full_rt = TxlRuntime.load(tiny_onnx_full)
    for rt in (ort_rt, ref_rt, full_rt):
        rt.reset()
    pos = 0
    for q in segments:
        seg = tokens[:, pos:pos + q]
        ref = ref_rt.step(seg)
        np.testing.assert_allclose(ort_rt.step(seg), ref, atol=TOL, rtol=0)
        np.testing.assert_allclose(full_rt.step(seg), ref, atol=TOL, rtol=0)
        pos += q
    for rt in (ort_rt, ref_rt):
        rt.reset()


def test_torch_fast_path_matches_reference(tiny_ckpt, ref_rt):
    fast = TxlRuntime.load(tiny_ckpt, backend="torch-fast", max_segment=16)
    tokens = np.random.default_rng(2).integers(0, 60, (2, 40))
    ref_rt.reset()
    for a in range(0, 40, 7):
        np.testing.assert_allclose(fast.step(tokens[:, a:a + 7]), ref_rt.step(tokens[:, a:a + 7]), atol=TOL, rtol=0)
    ref_rt.reset()


def test_segments_longer_than_max_segment_are_fed_in_pieces(ort_rt, ref_rt):
    tokens = np.random.default_rng(3).integers(0, 60, (2, 40))  # max_segment is 16
    np.testing.assert_allclose(_one_pass(ort_rt, tokens), _one_pass(ref_rt, tokens), atol=TOL, rtol=0)


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
    rng = np.random.default_rng(5)
    a, b = rng.integers(0, 60, (2, 20)), rng.integers(0, 60, (2, 6))
    for rt in (ort_rt, ref_rt):
        rt.reset()
        rt.step(a)
        rt.reset(rows=[1])
        got = rt.step(b)
        rt.reset()
        rt.step(a[:1])
        np.testing.assert_allclose(got[0], rt.step(b[:1])[0], atol=TOL)  # row 0 kept its memory
        rt.reset()
        np.testing.assert_allclose(got[1], rt.step(b[1:])[0], atol=TOL)  # row 1 started afresh
        rt.reset()


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
    _assert_state_equal(ort_rt.save_state(), before)
    ort_rt.reset()


def _other_ckpt(tmp_path):
    from helpers.tiny import TINY_VOCAB, make_tiny_model

    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    return save_checkpoint(tmp_path / "other", make_tiny_model(seed=1), Vocab(TINY_VOCAB))


def _assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


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
        _assert_state_equal(rt.save_state(), before)
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
    _assert_state_equal(rt.save_state(), seq.save_state())


# -- files ----------------------------------------------------------------------------------------------------
def test_export_never_overwrites_without_force(tiny_ckpt, tmp_path):
    from txl_deploy.exporters.onnx.export import export_onnx

    out = tmp_path / "m.onnx"
    out.write_bytes(b"precious")
    with pytest.raises(OutputExistsError):
        export_onnx(tiny_ckpt, out)
    assert out.read_bytes() == b"precious"
    result = CliRunner().invoke(main, ["export", str(tiny_ckpt), "--onnx", "-o", str(out), "--no-verify"])
    assert result.exit_code == 2 and "already exists" in result.output and out.read_bytes() == b"precious"


def test_interrupted_export_leaves_no_file(tiny_ckpt, tmp_path, monkeypatch):
    from txl_deploy.exporters.onnx import export
    from txl_deploy.exporters.onnx.export import export_onnx

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "verify_export", interrupted)

    with pytest.raises(KeyboardInterrupt):
        export_onnx(tiny_ckpt, tmp_path / "m.onnx", max_segment=16)
    assert list(tmp_path.iterdir()) == []


# -- CLI ------------------------------------------------------------------------------------------------------
def test_cli_export_verify_generate(tiny_ckpt, tmp_path):
    runner = CliRunner()
    out = tmp_path / "cli.onnx"
    r = runner.invoke(main, ["export", str(tiny_ckpt), "--onnx", "-o", str(out), "--max-segment", "16"])
    assert r.exit_code == 0, r.output
    assert "max abs difference" in r.output and "top-1 agreement" in r.output and "tolerance" in r.output
    r = runner.invoke(main, ["verify", str(out), "--against", str(tiny_ckpt)])
    assert r.exit_code == 0 and "OK" in r.output
    r = runner.invoke(main, ["generate", str(out), "--prompt", "w1 w2", "--max-new-tokens", "5", "--temperature", "0"])
    assert r.exit_code == 0 and r.output.startswith("w1 w2") and len(r.output.split()) == 7
    r = runner.invoke(main, ["generate", str(tiny_ckpt), "--prompt", "w1 w2", "--max-new-tokens", "5",
                             "--temperature", "0"])
    assert r.exit_code == 0


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


def test_large_models_write_external_data_beside_the_model(tiny_ckpt, tmp_path, monkeypatch):
    """Weights over protobuf's 2 GB limit go to a data file next to the .onnx; both land together, atomically."""
    from txl_deploy.exporters.onnx import export as onnx_exporter

    monkeypatch.setattr(onnx_exporter, "EXTERNAL_DATA_BYTES", 0)  # treat the tiny model as a large one
    out = tmp_path / "big.onnx"
    result = onnx_exporter.export_onnx(tiny_ckpt, out, max_segment=16)
    assert result.verification["passed"]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written[0] == "big.onnx" and len(written) == 2 and written[1].startswith("big.onnx")
    assert out.stat().st_size < 200_000  # the graph only; the weights are in the data file
    rt = TxlRuntime.load(out)
    assert rt.step([[1, 2, 3]]).shape == (1, 3, 60)
