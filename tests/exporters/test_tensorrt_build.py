"""The engine builder's checks that run before TensorRT is needed (CPU only; the builds are in test_tensorrt_gpu)."""

import json
import sys

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from txl_deploy.cli import main
from txl_deploy.config import TxlConfig
from txl_deploy.contract import engine_file
from txl_deploy.contract.metadata import ExportInfo, set_onnx_props
from txl_deploy.errors import CheckpointError, TxlError, install_hint
from txl_deploy.exporters.tensorrt import build as trt_build


def _onnx(path, precision="fp32", state="full", ours=True, qdq=False):
    """A tiny graph standing in for an export: the checks here read only its metadata and operators."""
    nodes = [helper.make_node("Identity", ["mem_count"], ["next_mem_count"], name="id")]
    if qdq:
        nodes = [helper.make_node("Cast", ["mem_count"], ["f"], to=TensorProto.FLOAT, name="c"),
                 helper.make_node("QuantizeLinear", ["f", "s", "z"], ["q"], name="q"),
                 helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"], name="dq"),
                 helper.make_node("Cast", ["d"], ["next_mem_count"], to=TensorProto.INT64, name="c2")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("mem_count", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("next_mem_count", TensorProto.INT64, ["batch"])],
        initializer=[helper.make_tensor("s", TensorProto.FLOAT, [], [0.5]),
                     helper.make_tensor("z", TensorProto.INT8, [], [0])] if qdq else [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if ours:
        config = TxlConfig(n_token=11, n_layer=1, n_head=2, d_model=8, d_head=4, d_inner=16, mem_len=4, tgt_len=4)
        info = ExportInfo(config, None, {"mem_len": 4, "state": state, "max_segment": 8, "precision": precision,
                                         "opset": 17})
        set_onnx_props(model, info)
    onnx.save(model, path)
    return path


@pytest.fixture
def no_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # `import tensorrt` raises ImportError


def _cli(*args):
    return CliRunner().invoke(main, ["build-engine", *map(str, args)])


# -- ranges ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("1:4:8", (1, 4, 8)), ("3", (3, 3, 3)), (" 2:2:2", (2, 2, 2))])
def test_parse_range(text, expected):
    assert trt_build.parse_range(text, "batch") == expected


@pytest.mark.parametrize("text, message", [
    ("1:8", "expected MIN:OPT:MAX"), ("a:b:c", "whole numbers"), ("0:1:4", "MIN must be >= 1"),
    ("4:2:8", "MIN <= OPT <= MAX"), ("1:9:8", "MIN <= OPT <= MAX"), ("1:2:3:4", "expected MIN:OPT:MAX")])
def test_parse_range_errors(text, message):
    with pytest.raises(TxlError, match=message):
        trt_build.parse_range(text, "segment")


def test_bad_range_on_the_command_line_is_a_usage_error(tmp_path):
    result = _cli(_onnx(tmp_path / "m.onnx"), "--segment", "8:1:4")
    assert result.exit_code == 2 and "MIN <= OPT <= MAX" in result.output


def test_profile_shapes_make_only_batch_dynamic_for_state():
    shapes = trt_build.profile_shapes(
        {"tokens": (-1, -1), "out_positions": (-1, -1), "mem_k.0": (-1, 2, 4, 16), "mem_count": (-1,)},
        batch=(1, 2, 8), segment=(1, 1, 32))
    assert shapes["tokens"] == ((1, 1), (2, 1), (8, 32))
    assert shapes["out_positions"] == ((1, 1), (2, 1), (8, 32))
    assert shapes["mem_k.0"] == ((1, 2, 4, 16), (2, 2, 4, 16), (8, 2, 4, 16))
    assert shapes["mem_count"] == ((1,), (2,), (8,))
    with pytest.raises(TxlError, match="only its batch dimension may be dynamic"):
        trt_build.profile_shapes({"mem_v.0": (-1, 2, -1, 4)}, (1, 1, 1), (1, 1, 1))


# -- refusals before the build -------------------------------------------------------------------------------
def test_missing_tensorrt_is_a_clear_error_and_writes_nothing(tmp_path, no_tensorrt):
    model = _onnx(tmp_path / "m.onnx")
    result = _cli(model, "-o", tmp_path / "m.engine")
    assert result.exit_code == 2
    assert install_hint("tensorrt") in result.output and "NVIDIA GPU" in result.output
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_onnx_not_made_by_txl_deploy(tmp_path, no_tensorrt):
    result = _cli(_onnx(tmp_path / "foreign.onnx", ours=False))
    assert result.exit_code == 2 and "not exported by txl-deploy" in result.output
    assert not (tmp_path / "foreign.engine").exists()


def test_fp16_needs_an_fp16_export(tmp_path, no_tensorrt):
    result = _cli(_onnx(tmp_path / "m.onnx"), "--fp16")
    assert result.exit_code == 2
    assert "fp32 graph" in result.output and "txl-deploy export CKPT --onnx --precision fp16" in result.output


def test_int8_without_calibration_or_qdq(tmp_path, no_tensorrt):
    result = _cli(_onnx(tmp_path / "m.onnx"), "--int8")
    assert result.exit_code == 2 and "--int8 needs calibration" in result.output
    result = _cli(_onnx(tmp_path / "m.onnx"), "--int8", "--calib", tmp_path / "text.txt")
    assert result.exit_code == 2 and "--precision int8 --calib" in result.output


def test_matching_precision_reaches_the_tensorrt_import(tmp_path, no_tensorrt):
    for precision, flag in (("fp16", "--fp16"), ("int8", "--int8")):
        result = _cli(_onnx(tmp_path / f"{precision}.onnx", precision=precision, qdq=precision == "int8"), flag)
        assert result.exit_code == 2 and "TensorRT is not available" in result.output


def test_incremental_layout_is_refused(tmp_path, no_tensorrt):
    result = _cli(_onnx(tmp_path / "m.onnx", state="incremental"))
    assert result.exit_code == 2 and "'full'" in result.output


def test_existing_engine_needs_force(tmp_path, no_tensorrt):
    model = _onnx(tmp_path / "m.onnx")
    (tmp_path / "m.engine").write_bytes(b"old")
    result = _cli(model)
    assert result.exit_code == 2 and "already exists" in result.output
    assert (tmp_path / "m.engine").read_bytes() == b"old"
    assert "TensorRT is not available" in _cli(model, "--force").output


def test_segment_beyond_the_graph(tmp_path, no_tensorrt):
    result = _cli(_onnx(tmp_path / "m.onnx"), "--segment", "1:1:64")
    assert result.exit_code == 2 and "max_segment 8" in result.output


# -- sidecars --------------------------------------------------------------------------------------------------------
def _sidecar(tmp_path, **changes):
    meta = {"format": engine_file.SIDECAR_FORMAT, "format_version": 1, "tensorrt_version": "10.3.0.26",
            "gpu": {"name": "Orin", "compute_capability": "8.7"}, "config": {}, "precision": "fp16"}
    meta.update(changes)
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"engine")
    engine_file.sidecar_path(engine).write_text(json.dumps(meta))
    return engine


def test_sidecar_version_and_gpu_checks(tmp_path):
    engine = _sidecar(tmp_path)
    meta = engine_file.read_sidecar(engine)
    orin = {"name": "Orin", "compute_capability": "8.7"}
    engine_file.check_sidecar_compatible(meta, "10.3.0.30", orin, engine)  # another build of 10.3.0 is fine
    with pytest.raises(CheckpointError, match=r"built with TensorRT 10\.3\.0\.26, but TensorRT 11\.4\.0\.106 is "
                                              r"installed; rebuild it"):
        engine_file.check_sidecar_compatible(meta, "11.4.0.106", orin, engine)
    with pytest.raises(CheckpointError, match=r"built for Orin \(compute capability 8\.7\), but this GPU is "
                                              r"NVIDIA H200 \(compute capability 9\.0\)"):
        engine_file.check_sidecar_compatible(meta, "10.3.0.26", {"name": "NVIDIA H200", "compute_capability": "9.0"},
                                           engine)


def test_sidecar_missing_or_foreign(tmp_path):
    engine = tmp_path / "x.engine"
    engine.write_bytes(b"engine")
    with pytest.raises(CheckpointError, match="no sidecar x.engine.json"):
        engine_file.read_sidecar(engine)
    engine_file.sidecar_path(engine).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt engine sidecar"):
        engine_file.read_sidecar(engine)
    engine_file.sidecar_path(engine).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(CheckpointError, match="not a txl-deploy engine sidecar"):
        engine_file.read_sidecar(engine)
    with pytest.raises(CheckpointError, match="engine file not found"):
        engine_file.read_sidecar(tmp_path / "missing.engine")


def test_help_mentions_every_option():
    result = CliRunner().invoke(main, ["build-engine", "--help"])
    assert result.exit_code == 0
    for option in ("--fp16", "--int8", "--calib", "--batch", "--segment", "--timing-cache", "--workspace",
                   "--output", "--force"):
        assert option in result.output
