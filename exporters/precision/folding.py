"""Weights computed from initializers (Slice/Concat/Transpose ...) folded into initializers and Gemms by a weight
rewritten as MatMuls, so the quantizers see every weight matrix; and the list of MatMuls by a weight matrix."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

_FOLDABLE = {"Transpose", "Slice", "Concat", "Reshape", "Unsqueeze", "Squeeze", "Identity"}


def fold_weight_subgraphs(model) -> int:
    """Turn MatMul weights computed from initializers (Slice/Concat/Transpose ...) into initializers, in place, and
    Gemms by a weight into MatMuls (`gemms_as_matmuls`).

    The adaptive softmax's head weight is a slice of the (tied) embedding with the cluster weights appended,
    transposed: the exporter emits that as nodes, so the head MatMul -- most of a WikiText-103 model's per-token
    work -- would not count as a weight MatMul and would stay in fp32. Returns the number of weights folded and of
    Gemms rewritten."""
    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    values: dict = {}

    def value(name):
        if name in values:
            return values[name]
        if name in inits:
            values[name] = numpy_helper.to_array(inits[name])
            return values[name]
        node = producers.get(name)
        if node is None or node.op_type not in _FOLDABLE or len(node.output) != 1:
            return None
        args = [value(i) if i else None for i in node.input]
        if any(a is None for a, i in zip(args, node.input) if i):
            return None
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        op, x = node.op_type, args[0]
        if op == "Transpose":
            out = np.transpose(x, attrs.get("perm"))
        elif op == "Concat":
            out = np.concatenate(args, axis=attrs["axis"])
        elif op == "Identity":
            out = x
        elif op == "Reshape":
            shape = [d if d != 0 else x.shape[i] for i, d in enumerate(args[1])]
            out = x.reshape(shape)
        elif op == "Unsqueeze":
            out = np.expand_dims(x, tuple(int(a) for a in args[1]))
        elif op == "Squeeze":
            out = np.squeeze(x, tuple(int(a) for a in args[1])) if len(args) > 1 else np.squeeze(x)
        else:  # Slice(data, starts, ends, axes, steps)
            starts, ends = args[1], args[2]
            axes = args[3] if len(args) > 3 and args[3] is not None else range(len(starts))
            steps = args[4] if len(args) > 4 and args[4] is not None else [1] * len(starts)
            index = [slice(None)] * x.ndim
            for a, b, e, st in zip(axes, starts, ends, steps):
                index[int(a)] = slice(int(b), int(e), int(st))
            out = x[tuple(index)]
        values[name] = np.ascontiguousarray(out)
        return values[name]

    folded = 0
    for node in model.graph.node:
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2 or node.input[1] in inits:
            continue
        w = value(node.input[1])
        if w is None or w.ndim != 2:
            continue
        name = node.input[1] + "_folded"
        if name not in inits:
            inits[name] = numpy_helper.from_array(w, name)
            model.graph.initializer.append(inits[name])
        node.input[1] = name
        folded += 1
    if folded:  # drop the nodes that only fed the folded weights
        prune_dead(model)
    return folded + gemms_as_matmuls(model)


def gemms_as_matmuls(model) -> int:
    """Rewrite every Gemm by a weight initializer as MatMul (and an Add of its bias), in place; returns how many.

    The fp32 graph reads a weight that narrows its product as [out, in] through Gemm(transB=1), the layout the
    one-token kernel streams fastest (`cached_step.dense`). The quantizers take MatMuls: MatMulNBits and
    MatMulInteger have no Gemm form. The weight is stored [in, out] for them (MatMulNBits repacks it anyway)."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes, rewritten = [], 0
    for node in model.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if (node.op_type != "Gemm" or len(node.input) < 2 or node.input[1] not in inits or attrs.get("transA", 0)
                or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0):
            nodes.append(node)
            continue
        weight = node.input[1]
        if attrs.get("transB", 0):
            name = weight + "_in_out"
            if name not in inits:
                inits[name] = numpy_helper.from_array(
                    np.ascontiguousarray(numpy_helper.to_array(inits[weight]).T), name)
                model.graph.initializer.append(inits[name])
            weight = name
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        product = node.output[0] + "_product" if bias else node.output[0]
        nodes.append(onnx.helper.make_node("MatMul", [node.input[0], weight], [product], name=node.name))
        if bias:
            nodes.append(onnx.helper.make_node("Add", [product, bias], [node.output[0]], name=node.name + "_bias"))
        rewritten += 1
    if rewritten:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
        prune_dead(model)  # the [out, in] copies no node reads now
    return rewritten


def prune_dead(model):
    needed = {o.name for o in model.graph.output}
    keep = []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    keep.reverse()
    del model.graph.node[:]
    model.graph.node.extend(keep)
    live = [t for t in model.graph.initializer if t.name in needed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(live)


def weight_matmuls(model) -> list[str]:
    """Names of the MatMul nodes whose second input is a 2-D weight matrix (an initializer)."""
    inits = {t.name: t for t in model.graph.initializer}
    return [n.name for n in model.graph.node
            if n.op_type in ("MatMul", "Gemm") and len(n.input) > 1 and n.input[1] in inits
            and len(inits[n.input[1]].dims) == 2]
