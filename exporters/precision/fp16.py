"""fp16: every float in FP16, the memory state included, except the log-softmax tail (see the package's docstring)."""

from __future__ import annotations

from txl_deploy.contract import io_spec
from txl_deploy.exporters.graph_checks import toposort

# Ops computed in FP32 in the fp16 graph (LogSoftmax with everything downstream of it): see the module docstring.
_FLOAT, _FLOAT16 = 1, 10  # onnx.TensorProto.FLOAT, FLOAT16
FP16_KEEP_FP32_OPS = ("LogSoftmax",)


def convert_fp16(model, keep_fp32_ops=FP16_KEEP_FP32_OPS):
    """fp32 ModelProto -> fp16 ModelProto: state in/out float16, log_probs float32, `keep_fp32_ops` in FP32.

    Every LogSoftmax and everything downstream of it (the adaptive softmax's cluster offsets and the Concat) stay
    in FP32 and feed `log_probs` directly, so log-probs are never rounded to fp16 on their way out."""
    from onnxruntime.transformers.float16 import convert_float_to_float16  # optional (the cpu or gpu extra)

    # keep_io_types as a list keeps only log_probs in float32 (keep_io_types=True would also keep the memory in
    # fp32 behind Casts; a float16 state halves its memory and transfers). The min_positive/max_finite clamp
    # applies to finite weights only, so the mask's -inf stays -inf.
    del model.graph.value_info[:]  # fp32 intermediate types would contradict the converted graph
    tail = _log_softmax_tail(model.graph)
    model = convert_float_to_float16(model, keep_io_types=[io_spec.LOG_PROBS], op_block_list=list(keep_fp32_ops),
                                     node_block_list=sorted(tail))
    _drop_fp16_round_trips(model.graph, tail)
    # The converter appends its Casts at the end of the node list, after the nodes that read them.
    toposort(model.graph)
    return model


def _log_softmax_tail(graph) -> set:
    """Names of the LogSoftmax nodes and of every node downstream of them (unnamed ones are given a name)."""
    names = {n.name for n in graph.node}
    for i, node in enumerate(graph.node):
        if not node.name:
            node.name = next(f"fp32_tail_{i}_{k}" for k in range(len(names) + 1) if f"fp32_tail_{i}_{k}" not in names)
            names.add(node.name)
    consumers = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    tail, todo = set(), [n for n in graph.node if n.op_type == "LogSoftmax"]
    while todo:
        node = todo.pop()
        if node.name in tail:
            continue
        tail.add(node.name)
        for out in node.output:
            todo.extend(consumers.get(out, []))
    return tail


def _drop_fp16_round_trips(graph, fp32_nodes: set):
    """Remove the fp32 -> fp16 -> fp32 Cast pairs the converter leaves between FP32 nodes and float32 outputs.

    The converter casts every output of a blocked node to fp16 and casts a kept graph output back to fp32, so the
    FP32 log-softmax result went through fp16 (steps of 2^-7 at magnitudes 8 to 16) before reaching `log_probs`."""
    producer = {o: n for n in graph.node for o in n.output}
    outputs = {o.name for o in graph.output}

    def cast_to(node):
        return next((a.i for a in node.attribute if a.name == "to"), None) if node.op_type == "Cast" else None

    drop, renames = set(), {}
    for node in graph.node:
        first = producer.get(node.input[0]) if cast_to(node) == _FLOAT else None
        if first is None or cast_to(first) != _FLOAT16:
            continue
        source = producer.get(first.input[0])
        if source is None or source.name not in fp32_nodes:
            continue
        drop.add(node.name)
        renames[node.output[0]] = first.input[0]  # read the fp32 tensor itself
    if not drop:
        return
    kept = [n for n in graph.node if n.name not in drop]
    for old, new in renames.items():
        if old in outputs:  # a graph output keeps its name: the fp32 producer writes it directly
            for n in kept:
                n.output[:] = [old if o == new else o for o in n.output]
                n.input[:] = [old if i == new else i for i in n.input]
        else:
            for n in kept:
                n.input[:] = [new if i == old else i for i in n.input]
    used = {i for n in kept for i in n.input} | outputs
    kept = [n for n in kept if not (cast_to(n) == _FLOAT16 and n.output[0] not in used)]  # orphaned fp16 Casts
    value_info = [v for v in graph.value_info if v.name in {o for n in kept for o in n.output}]
    # The converter named the FP32 outputs "<name>_cast_to_fp16" (its Cast wrote <name>): give the names back.
    defined = {o for n in kept for o in n.output}
    back = {o: o[:-len("_cast_to_fp16")] for n in kept if n.name in fp32_nodes for o in n.output
            if o.endswith("_cast_to_fp16") and o[:-len("_cast_to_fp16")] not in defined | outputs}
    for n in kept:
        n.input[:] = [back.get(i, i) for i in n.input]
        n.output[:] = [back.get(o, o) for o in n.output]
    kept = [_copy(n) for n in kept]  # detach them before the repeated field is cleared
    del graph.node[:]
    graph.node.extend(kept)
    del graph.value_info[:]
    graph.value_info.extend(value_info)


def _copy(message):
    out = type(message)()
    out.CopyFrom(message)
    return out
