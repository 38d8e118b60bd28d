"""ONNX export: the graph (static apart from the batch, self-describing), its parity with the PyTorch reference
however a stream is cut and once the memory's ring wraps, and its files (never overwritten without --force, nothing
left by an interrupted export, the weights of large models in a data file beside the graph).

Tolerance: fp32 log-probabilities within 1e-4 max abs difference of the eager reference (observed ~2e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.streams import one_pass, split_pass
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl_deploy.cli import main
from txl_deploy.errors import OutputExistsError
from txl_deploy.runtimes import TxlRuntime

TOL = 1e-4


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
    ref_whole = one_pass(ref_rt, tokens)
    for rt in (ref_rt, ort_rt):
        np.testing.assert_allclose(split_pass(rt, tokens, cuts), ref_whole, atol=TOL, rtol=0)


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

    monkeypatch.setattr(export, "verify_runtime", interrupted)

    with pytest.raises(KeyboardInterrupt):
        export_onnx(tiny_ckpt, tmp_path / "m.onnx", max_segment=16)
    assert list(tmp_path.iterdir()) == []


def test_large_models_write_external_data_beside_the_model(tiny_ckpt, tmp_path, monkeypatch):
    """Weights over protobuf's 2 GB limit go to a data file next to the .onnx; both land together, atomically.
    The same rule holds for every file the export writes: the adaptive softmax's parts (the body + head graph
    repeats the body and the tied embedding, so it crosses the limit with the model) keep their data files too."""
    from txl_deploy.contract.onnx_file import external_data
    from txl_deploy.exporters.onnx import export as onnx_exporter
    from txl_deploy.exporters.onnx import writing

    monkeypatch.setattr(writing, "EXTERNAL_DATA_BYTES", 0)  # treat the tiny model as a large one
    out = tmp_path / "big.onnx"
    result = onnx_exporter.export_onnx(tiny_ckpt, out, max_segment=16)
    assert result.verification["passed"]
    assert result.info.export["parts"]["verification"]["passed"]
    graphs = ["big.onnx", "big.head.onnx", "big.tail1.onnx", "big.tail2.onnx"]  # the model and its parts
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(graphs + [g + ".data" for g in graphs])
    for g in graphs:
        assert {ref.path.name for ref in external_data(tmp_path / g)} == {g + ".data"}
    assert out.stat().st_size < 200_000  # the graph only; the weights are in the data file
    rt = TxlRuntime.load(out)
    assert rt.backend.clusters is not None, rt.backend.parts_error  # the parts open from their data files
    assert rt.step([[1, 2, 3]]).shape == (1, 3, 60)
