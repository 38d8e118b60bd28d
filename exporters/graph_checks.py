"""Strict validity of an exported graph: what TensorRT's ONNX parser and other strict consumers require.

ONNX Runtime and OpenVINO sort a graph's nodes themselves and accept files that the ONNX specification does not
(IR.md, "Graphs": the nodes form "a topologically sorted list"); TensorRT's ONNX parser imports nodes in file order,
and `onnx.checker` with `full_check=True` and `polygraphy check lint` reject such files. So a graph can run in
every test here and still fail to build on a GPU. Every exporter calls `check_strict` as its last step before a
file is written:

- the nodes are in topological order (checked here first, so the error names the node and the tensor);
- `onnx.checker.check_model(..., full_check=True)`: the IR and operator schemas, plus strict shape and type
  inference over the whole graph.

`toposort` restores the order in place (a Kahn sort that keeps the existing order wherever it is already valid).
"""

from __future__ import annotations

import heapq
import re
import tempfile
from pathlib import Path

import onnx

from txl_deploy.errors import ExportError

# protobuf cannot serialise a message of 2 GiB or more: onnx.checker must then read the model from a path.
_PROTOBUF_LIMIT = 2**31 - 1


def _subgraphs(node):
    for a in node.attribute:
        if a.HasField("g"):
            yield a.g
        yield from a.graphs


def _outer_names(graph) -> set:
    """Names a subgraph reads from enclosing scopes: used by its nodes but defined nowhere inside it."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    used = set()
    for node in graph.node:
        used.update(node.input)
        for sub in _subgraphs(node):
            used.update(_outer_names(sub))
        defined.update(node.output)
    return used - defined


def _node_inputs(node) -> list:
    """Every tensor a node needs before it can run: its inputs and what its subgraphs read from outside."""
    names = list(node.input)
    for sub in _subgraphs(node):
        names.extend(sorted(_outer_names(sub)))
    return names


def _label(node, index: int) -> str:
    return f"{node.name or f'<node {index}>'} ({node.op_type})"


def toposort(graph) -> bool:
    """Put `graph.node` (and the nodes of every subgraph) in topological order, in place.

    Nodes whose inputs are ready keep their relative order, so an already sorted graph is left unchanged.
    Returns True when the order of this graph changed. A cycle raises ExportError naming a node on it."""
    changed = False
    for node in graph.node:
        for sub in _subgraphs(node):
            toposort(sub)
    nodes = list(graph.node)
    producer = {}
    for i, node in enumerate(nodes):
        for out in node.output:
            if out:
                producer[out] = i
    waiting = [0] * len(nodes)  # inputs of node i not yet produced
    consumers = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for name in set(_node_inputs(node)):
            j = producer.get(name)
            if j is not None and j != i:
                waiting[i] += 1
                consumers[j].append(i)
            elif j == i:
                raise ExportError(f"node {_label(node, i)} reads its own output {name!r}: the graph has a cycle")
    ready = [i for i in range(len(nodes)) if waiting[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for k in consumers[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, k)
    if len(order) != len(nodes):
        stuck = next(i for i in range(len(nodes)) if waiting[i] > 0)
        raise ExportError(f"node {_label(nodes[stuck], stuck)} is on a cycle: the graph cannot be sorted")
    if order != list(range(len(nodes))):
        changed = True
        sorted_nodes = [nodes[i] for i in order]
        copies = [type(n)() for n in sorted_nodes]
        for copy, n in zip(copies, sorted_nodes):
            copy.CopyFrom(n)
        del graph.node[:]
        graph.node.extend(copies)
    return changed


def first_unsorted(graph, outer=frozenset()):
    """(node, index, tensor) of the first node that reads a tensor a later node produces, or None."""
    produced_later = set()
    for node in graph.node:
        produced_later.update(o for o in node.output if o)
    available = set(outer) | {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    for i, node in enumerate(graph.node):
        for name in _node_inputs(node):
            if name not in available and name in produced_later:
                return node, i, name
        for sub in _subgraphs(node):
            found = first_unsorted(sub, available)
            if found:
                return found
        available.update(node.output)
    return None


_NODE_PATTERNS = (
    re.compile(r"name:\s*(\S+)\s+OpType:\s*(\S+)", re.IGNORECASE),  # checker: "Bad node spec for node. Name: X OpType: Y"
    re.compile(r"op_type:\s*(\w+),\s*node name:\s*([^)\s]+)"),  # shape inference: "(op_type:Y, node name: X)"
)


def _node_in_message(message: str) -> str | None:
    m = _NODE_PATTERNS[0].search(message)
    if m:
        return f"{m.group(1)} ({m.group(2)})"
    m = _NODE_PATTERNS[1].search(message)
    if m:
        return f"{m.group(2)} ({m.group(1)})"
    return None


def check_strict(model, what: str) -> None:
    """Raise ExportError naming the node unless `model` is valid for strict consumers.

    `model`: an onnx.ModelProto, or the path of a saved model (the way to check one with external data or over
    2 GB: onnx.checker then reads the weights beside it). `what` names the graph in the message."""
    path = None
    if isinstance(model, (str, Path)):
        path = str(model)
        try:
            model = onnx.load(path, load_external_data=False)  # node order needs no weights
        except Exception as e:  # DecodeError, OSError, ...: not a readable ONNX file at all
            raise ExportError(f"{what}: cannot read {path} as ONNX ({type(e).__name__})") from None
    unsorted = first_unsorted(model.graph)
    if unsorted:
        node, index, tensor = unsorted
        raise ExportError(f"{what}: node {_label(node, index)} reads {tensor!r} before the node that produces it: the nodes are "
                          "not in topological order (TensorRT's ONNX parser and onnx.checker need them sorted)")
    try:
        if path is not None:
            onnx.checker.check_model(path, full_check=True)
        elif model.ByteSize() > _PROTOBUF_LIMIT:
            _check_large(model)
        else:
            onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as e:
        message = " ".join(str(e).split())
        node = _node_in_message(message)
        where = f" at node {node}" if node else ""
        raise ExportError(f"{what}: fails onnx.checker (full_check){where}: {message[:400]}") from None


def _check_large(model):
    """A ModelProto over protobuf's limit: save it with external data and check the file (onnx.checker's way)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # saving with external data moves the weights out of the proto it saves
    with tempfile.TemporaryDirectory(prefix="txl-strict-") as work:
        path = Path(work) / "model.onnx"
        onnx.save_model(copy, str(path), save_as_external_data=True, location="model.onnx.data")
        onnx.checker.check_model(str(path), full_check=True)


__all__ = ["check_strict", "toposort", "first_unsorted"]
