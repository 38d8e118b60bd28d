"""The static TensorRT-compatibility check, on small hand-built ONNX graphs (no TensorRT needed)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from txl_deploy.errors import ExportError
from txl_deploy.exporters.tensorrt.compat import SUPPORTED_OPS, check_tensorrt_compat


def _model(nodes, inputs=None, outputs=None, initializers=(), opset=17, value_info=()):
    inputs = inputs or [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])]
    outputs = outputs or [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])]
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers), value_info=list(value_info))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _qdq(zero_point):
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "scale")
    zp = numpy_helper.from_array(np.array(zero_point), "zp")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "scale", "zp"], ["q"], name="q0"),
        helper.make_node("DequantizeLinear", ["q", "scale", "zp"], ["y"], name="dq0"),
    ]
    return _model(nodes, initializers=[scale, zp])


def test_a_plain_transformer_block_passes(tmp_path):
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    g = numpy_helper.from_array(np.ones(4, np.float32), "g")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
        helper.make_node("LayerNormalization", ["h", "g"], ["n"], name="ln", axis=-1),
        helper.make_node("Softmax", ["n"], ["y"], name="sm", axis=-1),
    ]
    model = _model(nodes, initializers=[w, g])
    onnx.checker.check_model(model)
    path = tmp_path / "ok.onnx"
    onnx.save(model, path)
    report = check_tensorrt_compat(path)
    assert report.ok and report.problems == [] and report.trt_majors == (10, 11)
    assert report.raise_if_failed() is report
    assert "compatible" in str(report)


def test_symmetric_int8_qdq_passes():
    model = _qdq(np.int8(0))
    onnx.checker.check_model(model)
    assert check_tensorrt_compat(model).ok


@pytest.mark.parametrize(
    "zero_point, why",
    [(np.int8(3), "not all zeros"), (np.uint8(0), "not int8"), (np.uint8(128), "not int8")],
)
def test_qdq_zero_points_must_be_int8_zeros(zero_point, why):
    report = check_tensorrt_compat(_qdq(zero_point))
    assert [p.node for p in report.problems] == ["q0", "dq0"]
    assert all(why in p.why for p in report.problems)


def test_qdq_zero_point_that_is_not_a_constant_is_reported():
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "scale")
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zp_in"], ["y"], name="q_dyn")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
              helper.make_tensor_value_info("zp_in", TensorProto.INT8, [])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.INT8, [2, 4])]
    report = check_tensorrt_compat(_model(nodes, inputs, outputs, initializers=[scale]))
    assert [(p.node, p.op) for p in report.problems] == [("q_dyn", "QuantizeLinear")]
    assert "not a constant" in report.problems[0].why


def test_dynamic_quantize_linear_is_refused():
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dyn_q"),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dyn_dq"),
    ]
    report = check_tensorrt_compat(_model(nodes))
    by_node = {p.node: p for p in report.problems}
    assert by_node["dyn_q"].op == "DynamicQuantizeLinear" and "int8-dynamic" in by_node["dyn_q"].why
    assert "dyn_dq" in by_node  # its zero-point is no constant either


@pytest.mark.parametrize("op", ["NonZero", "If", "Loop"])
def test_control_flow_and_data_dependent_shapes_are_refused(op):
    if op == "NonZero":
        node = helper.make_node("NonZero", ["x"], ["y"], name="nz")
    else:
        body = helper.make_graph([helper.make_node("Identity", ["x"], ["b"])], "body", [],
                                 [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
        if op == "If":
            node = helper.make_node("If", ["cond"], ["y"], name="nz", then_branch=body, else_branch=body)
        else:
            node = helper.make_node("Loop", ["", "cond"], ["y"], name="nz", body=body)
    report = check_tensorrt_compat(_model([node]))
    assert [(p.node, p.op) for p in report.problems] == [("nz", op)]
    with pytest.raises(ExportError, match=rf"nz \({op}\)"):
        report.raise_if_failed()


def test_unsupported_operator_names_the_node_and_the_versions():
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="fine"),
        helper.make_node("MatMulInteger", ["h", "h"], ["y"], name="mmi"),
    ]
    report = check_tensorrt_compat(_model(nodes))
    assert [(p.node, p.op) for p in report.problems] == [("mmi", "MatMulInteger")]
    assert "TensorRT 10.x/11.x" in report.problems[0].why
    with pytest.raises(ExportError) as e:
        report.raise_if_failed()
    assert "mmi (MatMulInteger)" in str(e.value) and "\n" not in str(e.value)


def test_operator_tables_differ_between_majors():
    # Swish arrived in 11.0; RMSNormalization in 10.15 (not in JetPack 6's 10.3).
    swish = _model([helper.make_node("Swish", ["x"], ["y"], name="sw")], opset=24)
    assert check_tensorrt_compat(swish, trt_major=11).ok
    # the 10.x parser knows neither the operator nor opset 24
    assert [p.node for p in check_tensorrt_compat(swish, trt_major=10).problems] == ["<model>", "sw"]
    assert all("10.x" in p.why for p in check_tensorrt_compat(swish).problems)
    assert "Swish" not in SUPPORTED_OPS[10] and "RMSNormalization" not in SUPPORTED_OPS[10]
    with pytest.raises(ExportError, match="TensorRT 9.x"):
        check_tensorrt_compat(swish, trt_major=9)


def test_contrib_domain_ops_are_refused():
    node = helper.make_node("FusedMatMul", ["x", "x"], ["y"], name="fused", domain="com.microsoft")
    report = check_tensorrt_compat(_model([node]))
    assert [(p.node, p.op) for p in report.problems] == [("fused", "FusedMatMul")]
    assert "com.microsoft" in report.problems[0].why


def test_zero_size_dimensions_are_refused():
    empty = numpy_helper.from_array(np.zeros((0, 4), np.float32), "empty_mem")
    nodes = [helper.make_node("Concat", ["empty_mem", "x"], ["y"], name="cat", axis=0)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [0, 4])]
    vi = [helper.make_tensor_value_info("mid", TensorProto.FLOAT, ["batch", 0])]
    report = check_tensorrt_compat(_model(nodes, inputs=inputs, initializers=[empty], value_info=vi))
    assert {(p.node, p.op) for p in report.problems} == {
        ("empty_mem", "initializer"), ("x", "declared shape"), ("mid", "declared shape")}


def test_old_opset_is_refused():
    report = check_tensorrt_compat(_model([helper.make_node("Relu", ["x"], ["y"], name="r")], opset=13))
    assert [p.node for p in report.problems] == ["<model>"]
    assert "opset 13 < 17" in report.problems[0].why


def test_opsets_newer_than_the_parser_documents_are_refused():
    # onnx-tensorrt docs/operators.md: TensorRT 10.x parses opsets 9 to 20; TensorRT 11.x up to 25.
    relu = [helper.make_node("Relu", ["x"], ["y"], name="r")]
    assert check_tensorrt_compat(_model(relu, opset=20)).ok
    report = check_tensorrt_compat(_model(relu, opset=21))
    assert [p.node for p in report.problems] == ["<model>"]
    assert "opset 21 is newer than the TensorRT 10.x parser supports (20)" in report.problems[0].why
    assert check_tensorrt_compat(_model(relu, opset=25), trt_major=11).ok
    assert not check_tensorrt_compat(_model(relu, opset=26), trt_major=11).ok


def test_nodes_out_of_topological_order_are_refused():
    # The table once passed such a graph while `polygraphy check lint` and onnx.checker rejected it. The ONNX IR
    # requires a topologically sorted node list and TensorRT's parser imports nodes in file order, so the linter was
    # right: the fp16 export had a LogSoftmax before the Cast that fed it.
    nodes = [
        helper.make_node("LogSoftmax", ["h32"], ["y"], name="node_log_softmax", axis=-1),
        helper.make_node("Cast", ["x"], ["h32"], name="cast_to_fp32", to=TensorProto.FLOAT),
    ]
    report = check_tensorrt_compat(_model(nodes))
    assert [(p.node, p.op) for p in report.problems] == [("node_log_softmax", "LogSoftmax")]
    assert "'h32' before the node that produces it" in report.problems[0].why
    assert check_tensorrt_compat(_model(nodes[::-1])).ok


def test_int8_dynamic_operators_are_not_in_the_tensorrt_tables():
    # Polygraphy lints the int8-dynamic graph clean (it checks ONNX validity through ONNX Runtime); TensorRT's
    # operator matrix (onnx-tensorrt docs/operators.md, 10.15) marks DynamicQuantizeLinear and MatMulInteger "N".
    for major in (10, 11):
        assert "MatMulInteger" not in SUPPORTED_OPS[major] and "DynamicQuantizeLinear" not in SUPPORTED_OPS[major]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="dql"),
        helper.make_node("MatMulInteger", ["q", "q"], ["y"], name="mmi"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.INT32, ["batch", 4])]
    report = check_tensorrt_compat(_model(nodes, outputs=outputs))
    assert [(p.node, p.op) for p in report.problems] == [("dql", "DynamicQuantizeLinear"), ("mmi", "MatMulInteger")]


def test_unreadable_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"this is not protobuf \xff\xfe")
    with pytest.raises(ExportError, match="model.onnx: cannot read as ONNX"):
        check_tensorrt_compat(bad)
