"""Strict validity of every export: onnx.checker full_check, topological order and `polygraphy check lint`.

The variants (every precision x state layout x supported opset, and external data) are built once per session
from the tiny model (tests/helpers/strict_variants.py); `python tests/helpers/strict_variants.py` prints the same
checks as a table.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from helpers.strict_variants import Variants, check_file, polygraphy_lint, variant_keys, variant_name
from onnx import TensorProto, helper, numpy_helper

from txl_deploy.errors import ExportError
from txl_deploy.exporters.graph_checks import check_strict, first_unsorted, toposort

KEYS = variant_keys()
IDS = [variant_name(k) for k in KEYS]


@pytest.fixture(scope="session")
def variants(tiny_ckpt, tiny_onnx, tiny_onnx_full, tmp_path_factory):
    # conftest's session exports are the default-opset fp32 variants already
    prebuilt = {("fp32", "incremental", 18, False): tiny_onnx, ("fp32", "full", 18, False): tiny_onnx_full}
    return Variants(tiny_ckpt, tmp_path_factory.mktemp("variants"), prebuilt)


@pytest.fixture(scope="session")
def lint_results(variants, tmp_path_factory):
    return polygraphy_lint([variants[k] for k in KEYS], tmp_path_factory.mktemp("lint"))


# -- every variant --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", KEYS, ids=IDS)
def test_variant_passes_full_check_in_topological_order(variants, key):
    precision, state, opset, external = key
    path = variants[key]
    assert check_file(path) == {"full_check": "pass", "toposort": "pass"}
    check_strict(path, variant_name(key))  # the exporter's own last step agrees
    model = onnx.load(str(path), load_external_data=False)
    assert first_unsorted(model.graph) is None
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) == opset
    props = {p.key: p.value for p in model.metadata_props}
    export = __import__("json").loads(props["txl_deploy.export"])
    assert (export["precision"], export["state"], export["opset"]) == (precision, state, opset)
    parts = {f"{path.stem}.head.onnx"} | {f"{path.stem}.tail{i}.onnx" for i in range(1, 10)}  # the softmax's parts
    data = [p for p in path.parent.iterdir() if p.name != path.name and p.name not in parts]
    assert bool(data) == external  # the weights file travels beside the model, and only when asked for
    if external:
        assert any(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)


@pytest.mark.parametrize("key", KEYS, ids=IDS)
def test_variant_passes_polygraphy_lint(variants, lint_results, key):
    result = lint_results[str(variants[key])]
    assert result["errors"] == [] and result["status"] == 0, result


@pytest.mark.parametrize("key", [k for k in KEYS if k[2] == 18 and not k[3]], ids=lambda k: variant_name(k))
def test_tensorrt_table_and_polygraphy_on_each_variant(variants, lint_results, key):
    """Polygraphy lints every variant clean: it checks ONNX validity through ONNX Runtime, not TensorRT. The table
    refuses int8-dynamic for what TensorRT's operator matrix marks unsupported, and nothing else."""
    from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat

    report = check_tensorrt_compat(variants[key])
    assert lint_results[str(variants[key])]["errors"] == []
    if key[0] == "int8-dynamic":
        assert {p.op for p in report.problems} == {"DynamicQuantizeLinear", "MatMulInteger"}
    else:
        assert report.ok, str(report)


# -- fp16 log-probs are float32 -------------------------------------------------------------------------------
@pytest.mark.parametrize("state", ["incremental", "full"])
def test_fp16_log_probs_never_pass_through_fp16(variants, state):
    model = onnx.load(str(variants[("fp16", state, 18, False)]))
    graph = model.graph
    assert graph.output[0].name == "log_probs" and graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    producer = {o: n for n in graph.node for o in n.output}
    # Walk back from log_probs to the LogSoftmax nodes: nothing on the way may be a Cast to fp16.
    seen, todo, log_softmax = set(), ["log_probs"], 0
    while todo:
        node = producer.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type == "LogSoftmax":
            log_softmax += 1
            continue
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        assert not (node.op_type == "Cast" and to == TensorProto.FLOAT16), f"{node.name} rounds log-probs to fp16"
        todo.extend(node.input)
    assert log_softmax == 3  # the adaptive softmax's head and its two tail clusters


def test_fp16_log_probs_are_not_rounded_to_fp16(variants):
    from txl_deploy.runtimes import TxlRuntime

    tokens = np.random.default_rng(5).integers(0, 60, size=(2, 12))
    with TxlRuntime.load(variants[("fp16", "incremental", 18, False)]) as rt:
        lp = rt.step(tokens)
    assert lp.dtype == np.float32
    representable = lp.astype(np.float16).astype(np.float32) == lp
    # Through an fp16 round trip every value would be representable; fp32 results almost never are.
    assert representable.mean() < 0.1, representable.mean()


# -- check_strict and toposort --------------------------------------------------------------------------------
def _graph_model(nodes, opset=18, initializers=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph(nodes, "g", [x], [y], initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _chain():
    return [helper.make_node("Relu", ["x"], ["a"], name="relu"),
            helper.make_node("Neg", ["a"], ["b"], name="neg"),
            helper.make_node("Add", ["a", "b"], ["c"], name="add"),
            helper.make_node("Identity", ["c"], ["y"], name="out")]


def test_toposort_restores_the_order_and_keeps_a_sorted_graph_as_it_is():
    nodes = _chain()
    model = _graph_model([nodes[3], nodes[2], nodes[0], nodes[1]])
    with pytest.raises(ExportError, match=r"node out \(Identity\) reads 'c' before the node that produces it"):
        check_strict(model, "shuffled")
    assert toposort(model.graph) is True
    assert [n.name for n in model.graph.node] == ["relu", "neg", "add", "out"]
    check_strict(model, "sorted")
    assert toposort(model.graph) is False


def test_toposort_reports_a_cycle():
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"),
             helper.make_node("Neg", ["a"], ["b"], name="second"),
             helper.make_node("Identity", ["a"], ["y"], name="out")]
    with pytest.raises(ExportError, match="cycle"):
        toposort(_graph_model(nodes).graph)


def test_toposort_sees_what_subgraphs_read_from_outside():
    then = helper.make_graph([helper.make_node("Identity", ["a"], ["t"], name="then_id")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, ["batch", 4])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"], name="else_id")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, ["batch", 4])])
    cond = numpy_helper.from_array(np.array(True), "cond")
    nodes = [helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other),
             helper.make_node("Relu", ["x"], ["a"], name="relu")]  # the If reads `a` inside its branch
    model = _graph_model(nodes, initializers=[cond])
    assert first_unsorted(model.graph)[0].name == "branch"
    toposort(model.graph)
    assert [n.name for n in model.graph.node] == ["relu", "branch"]
    check_strict(model, "if-graph")


def test_check_strict_names_the_node_onnx_checker_refuses():
    nodes = _chain()[:2] + [helper.make_node("Add", ["a", "b"], ["c"], name="bad_add", not_an_attribute=1),
                            _chain()[3]]
    with pytest.raises(ExportError, match=r"fails onnx.checker \(full_check\) at node bad_add \(Add\)"):
        check_strict(_graph_model(nodes), "graph")


def test_check_strict_runs_shape_inference_strictly():
    # MatMul of [batch, 4] by a [3, 4] weight: valid op by op, wrong only by its shapes (full_check finds it).
    w = numpy_helper.from_array(np.ones((3, 4), np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    onnx.checker.check_model(_graph_model(nodes, initializers=[w]))  # the plain check passes
    with pytest.raises(ExportError, match=r"fails onnx.checker \(full_check\).*mm"):
        check_strict(_graph_model(nodes, initializers=[w]), "graph")


def test_check_strict_of_a_path_with_external_data_and_of_a_large_proto(tmp_path, monkeypatch):
    def model_with_weight():
        w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
        return _graph_model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], initializers=[w])

    path = tmp_path / "m.onnx"
    onnx.save_model(model_with_weight(), str(path), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)
    check_strict(path, "external")
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(ExportError, match="fails onnx.checker"):
        check_strict(path, "external without its data")
    # a proto over protobuf's limit is checked through a file (the limit is lowered to reach that path)
    from txl_deploy.exporters import graph_checks as strict

    monkeypatch.setattr(strict, "_PROTOBUF_LIMIT", 10)
    model = model_with_weight()
    check_strict(model, "large")
    assert model.graph.initializer[0].data_location == TensorProto.DEFAULT  # the caller's model is untouched


def test_exporter_refuses_to_write_a_graph_that_fails(tiny_ckpt, tmp_path, monkeypatch):
    from txl_deploy.exporters.onnx import export as onnx_export
    from txl_deploy.exporters.onnx import writing

    real = writing.check_strict

    def shuffle(path, what):  # the main graph fails; the softmax parts, checked too, pass
        if what != "the exported graph":
            return real(path, what)
        raise ExportError(f"{what}: node node_log_softmax (LogSoftmax) reads 'x' before the node that produces it")

    monkeypatch.setattr(writing, "check_strict", shuffle)  # every exported file is checked through writing
    out = tmp_path / "refused.onnx"
    with pytest.raises(ExportError, match=r"the exported graph: node node_log_softmax \(LogSoftmax\)"):
        onnx_export.export_onnx(tiny_ckpt, out, max_segment=16, verify=False)
    assert list(tmp_path.iterdir()) == []  # nothing written, no partial file left


@pytest.mark.parametrize("opset", [16, 21])
def test_unsupported_opsets_are_refused_up_front(tiny_ckpt, tmp_path, opset):
    from txl_deploy.exporters.onnx.export import export_onnx

    with pytest.raises(ExportError, match=f"opset {opset} is not supported: choose 17 to 20"):
        export_onnx(tiny_ckpt, tmp_path / "x.onnx", opset=opset)
