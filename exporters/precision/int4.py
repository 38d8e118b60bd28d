"""int4: weight-only, block-wise 4-bit weights through ONNX Runtime's MatMulNBits (com.microsoft)."""

from __future__ import annotations

import logging

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from txl_deploy.errors import ExportError, InputError
from txl_deploy.exporters.graph_checks import check_strict
from txl_deploy.exporters.precision.folding import prune_dead, weight_matmuls

logger = logging.getLogger(__name__)

# Block sizes MatMulNBits takes (powers of two from 16). 64 by default: the demo model's bits per character +0.47%
# against fp32 (32: +0.43%, 128: +0.52%; the gate is 2%), and the smallest WikiText-103 base file (97.0 MB against
# 97.2 MB at 32 and 104.8 MB at 128, whose blocks pad d_model 410 to 512). On the CPU an int4 decode step is bound
# by its work per block more than by its bytes (block 128 decoded 16% faster than 32 while reading more), and 64
# halves 32's blocks (benchmarks/int4.py measures 32, 64 and 128 side by side).
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
INT4_DEFAULT_BLOCK = 64
# accuracy_level 4: the CPU kernels quantize each activation block to int8 and run int8 dot products (MLAS's
# VNNI / AMX / Arm dot-product paths); level 0 would dequantize the weights to fp32 for every product.
INT4_ACCURACY_LEVEL = 4


def quantize_int4(model, block_size: int = INT4_DEFAULT_BLOCK, accuracy_level: int = INT4_ACCURACY_LEVEL,
                  symmetric: bool = False) -> dict:
    """int4 weight-only quantization of an fp32 ModelProto, in place; returns what was done (for the metadata).

    - Every MatMul by a 2-D weight (after `fold_weight_subgraphs`, so the adaptive-softmax head and tails are among
      them) becomes MatMulNBits: 4-bit weights in blocks of `block_size` along the input dimension, one fp32 scale
      (and, unless `symmetric`, one 4-bit zero point) per block.
    - Embedding tables become GatherBlockQuantized. A table tied to the output layer (`tie_weight`: its rows are
      columns of the softmax weights) reads the output layer's 4-bit blocks instead of a copy of its own, so the
      file holds the 110M-parameter WikiText-103 vocabulary once; any other table is quantized the same way.
    - The scales and the per-layer positional tables (`r_table`) are stored in fp16 and cast to fp32 when the
      session loads (see `_store_fp16`).
    - Everything else (activations, attention, layer norms, the memory state, log_probs) stays fp32.
    """
    if block_size not in INT4_BLOCK_SIZES:
        raise InputError(f"int4 block size {block_size}: expected one of {', '.join(map(str, INT4_BLOCK_SIZES))}")
    nodes = weight_matmuls(model)
    others = [n.name for n in model.graph.node if n.op_type in ("MatMul", "Gemm") and n.name not in nodes]
    tables = _embedding_tables(model)
    ties = _find_ties(model, tables, nodes)  # before quantization: matched on the fp32 values
    MatMulNBitsQuantizer = _nbits_quantizer()
    quantizer = MatMulNBitsQuantizer(model, bits=4, block_size=block_size, is_symmetric=symmetric,
                                     accuracy_level=accuracy_level, nodes_to_include=nodes, nodes_to_exclude=others,
                                     op_types_to_quantize=("MatMul",))
    quantizer.process()
    quantized = quantizer.model.model
    if quantized is not model:
        model.CopyFrom(quantized)
    n_nbits = sum(n.op_type == "MatMulNBits" for n in model.graph.node)
    if n_nbits != len(nodes):
        raise ExportError(f"int4: {n_nbits} of {len(nodes)} weight MatMuls became MatMulNBits")
    tied = _quantize_gathers(model, tables, ties, block_size, symmetric)
    stored = _store_fp16(model)
    prune_dead(model)
    logger.info(f"int4: {n_nbits} weight MatMuls -> MatMulNBits (block {block_size}, accuracy_level {accuracy_level}), "
                f"{len(tables)} embedding table(s) -> GatherBlockQuantized ({tied} reading the tied output layer); "
                f"scales and {stored['positional_tables']} positional table(s) stored in fp16")
    return {"format": "MatMulNBits (com.microsoft)", "bits": 4, "block_size": block_size,
            "accuracy_level": accuracy_level, "symmetric": symmetric, "ops": "weight MatMuls incl. output layer",
            "matmuls": n_nbits, "embedding_tables": len(tables), "embedding_tied_to_output": tied,
            "stored_fp16": "scales, positional tables (cast to fp32 on load)", "state_dtype": "float32"}


def _nbits_quantizer():
    """onnxruntime's MatMulNBitsQuantizer, imported without the INFO logging its module switches on for everyone.

    The module calls logging.basicConfig(level=INFO) on import and logs a line per node: that would leave the
    root logger of the user's process at INFO and print thousands of lines per export."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer  # optional (the cpu or gpu extra)

    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer


def _embedding_tables(model) -> dict:
    """Gather nodes that look up rows of a 2-D float initializer: node name -> (node, table [V, d] ndarray)."""
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or node.input[0] not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        t = inits[node.input[0]]
        if axis in (0, 1) and len(t.dims) == 2 and t.data_type == 1:  # FLOAT
            # axis 1: a tied embedding reading the output weight [d, V] by columns; its rows are the columns.
            table = numpy_helper.to_array(t)
            out[node.name] = (node, table if axis == 0 else np.ascontiguousarray(table.T))
    return out


def _find_ties(model, tables: dict, matmuls: list[str]) -> dict:
    """For each embedding table, the output-layer weights that hold its rows as columns, if they cover it.

    Returns table node name -> [(matmul output name, first weight column, n rows, first table row), ...] in table
    order. Matched on exact fp32 values, so only truly tied weights (`tie_weight`) share their blocks."""
    inits = {t.name: t for t in model.graph.initializer}
    weights = {}
    for node in model.graph.node:
        if node.name in matmuls:
            weights[node.output[0]] = numpy_helper.to_array(inits[node.input[1]])
    ties = {}
    for name, (_, table) in tables.items():
        rows = {hash(table[i].tobytes()): i for i in range(table.shape[0] - 1, -1, -1)}  # first occurrence wins
        pieces = []
        for out, w in weights.items():
            if w.shape[0] != table.shape[1]:
                continue
            cols = np.ascontiguousarray(w.T)
            col = 0
            while col < cols.shape[0]:
                start = rows.get(hash(cols[col].tobytes()))
                if start is None or not np.array_equal(cols[col], table[start]):
                    col += 1
                    continue
                n = min(cols.shape[0] - col, table.shape[0] - start)
                same = np.all(cols[col:col + n] == table[start:start + n], axis=1)
                n = int(np.argmin(same)) if not same.all() else n
                pieces.append((out, col, n, start))
                col += n
        pieces.sort(key=lambda p: p[3])
        covered = 0
        for _, _, n, start in pieces:  # contiguous cover of every row, in order
            if start != covered:
                break
            covered += n
        if pieces and covered == table.shape[0]:
            chosen, covered = [], 0
            for p in pieces:
                if p[3] == covered:
                    chosen.append(p)
                    covered += p[2]
            ties[name] = chosen
    return ties


def _quantize_gathers(model, tables: dict, ties: dict, block_size: int, symmetric: bool) -> int:
    """Replace each embedding Gather by GatherBlockQuantized (+ a Slice when d is not a multiple of the block)."""
    _nbits_quantizer()  # the module, imported quietly
    # optional (the cpu or gpu extra)
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    new_inits, new_nodes = [], {}  # Gather node name -> replacement nodes
    tied = 0

    def const(name, array):
        new_inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def nbits_of(out):
        node = producers[out]
        while node.op_type != "MatMulNBits":  # the quantizer may add a Reshape after MatMulNBits
            node = producers[node.input[0]]
        return node

    for name, (node, table) in tables.items():
        V, d = table.shape
        k_blocks = -(-d // block_size)
        parts = {"data": [], "scales": [], "zp": []}
        nodes = []
        if name in ties:
            tied += 1
            for j, (out, col, n, _) in enumerate(ties[name]):
                mm = nbits_of(out)
                b, scales = mm.input[1], mm.input[2]
                zp = mm.input[3] if len(mm.input) > 3 and mm.input[3] else None
                for kind, src in (("data", b), ("scales", scales), ("zp", zp)):
                    if src is None:
                        continue
                    rows = int(inits[src].dims[0]) if src in inits else None
                    if col == 0 and rows == n:
                        parts[kind].append(src)
                        continue
                    piece = f"{name}_{kind}_{j}"
                    nodes.append(helper.make_node(
                        "Slice", [src, const(piece + "_starts", [col]), const(piece + "_ends", [col + n]),
                                  const(piece + "_axes", [0])], [piece], name=piece))
                    parts[kind].append(piece)
        else:
            config = DefaultWeightOnlyQuantConfig(block_size=block_size, is_symmetric=symmetric)
            packed, scales, zp = DefaultWeightOnlyQuantizer(config).qbits_block_quant(np.ascontiguousarray(table.T))
            # Scales rounded to fp16 as `_store_fp16` stores a MatMulNBits' scales: a table that is a tied one's
            # copy elsewhere (the head graph holds the tail clusters' rows without their output weights) then
            # dequantizes to exactly the values the model's tied embedding reads.
            half = scales.astype(np.float16)
            if np.isfinite(half).all():
                scales = half.astype(scales.dtype)
            parts["data"].append(const(f"{name}_Q4", packed))
            parts["scales"].append(const(f"{name}_scales", scales.reshape(V, k_blocks)))
            if not symmetric:
                parts["zp"].append(const(f"{name}_zero_points", zp.reshape(V, -1)))
        inputs = []
        for kind in ("data", "scales", "zp"):
            srcs = parts[kind]
            if not srcs:
                continue
            joined = srcs[0]
            if len(srcs) > 1:
                joined = f"{name}_{kind}"
                nodes.append(helper.make_node("Concat", srcs, [joined], name=joined, axis=0))
            if kind == "data":  # [V, k_blocks, block / 2] -> [V, k_blocks * block / 2]: the bytes of one row
                flat = f"{name}_data_rows"
                nodes.append(helper.make_node("Reshape", [joined, const(flat + "_shape", [V, -1])], [flat],
                                              name=flat))
                joined = flat
            elif kind == "scales":
                flat = f"{name}_scales_rows"
                nodes.append(helper.make_node("Reshape", [joined, const(flat + "_shape", [V, k_blocks])], [flat],
                                              name=flat))
                joined = flat
            inputs.append(joined)
        padded = k_blocks * block_size != d
        by_columns = next((a.i for a in node.attribute if a.name == "axis"), 0) == 1
        rows_out = node.output[0] + ("_rows" if by_columns else "")
        out = rows_out + ("_padded" if padded else "")
        nodes.append(helper.make_node("GatherBlockQuantized", [inputs[0], node.input[1], *inputs[1:]], [out],
                                      name=f"{name}_q4", domain="com.microsoft", gather_axis=0, quantize_axis=1,
                                      block_size=block_size, bits=4))
        if padded:  # the last block of each row was zero-padded to the block size
            nodes.append(helper.make_node("Slice", [out, const(f"{name}_trim_starts", [0]),
                                                    const(f"{name}_trim_ends", [d]), const(f"{name}_trim_axes", [-1])],
                                          [rows_out], name=f"{name}_trim"))
        if by_columns:  # [N, d] rows back to the Gather's [d, N] (the cached step gathers with 1-D indices)
            nodes.append(helper.make_node("Transpose", [rows_out], [node.output[0]], name=f"{name}_columns",
                                          perm=[1, 0]))
        new_nodes[name] = nodes
    rebuilt = []
    for node in graph.node:
        rebuilt.extend(new_nodes.get(node.name, [node]))
    del graph.node[:]
    graph.node.extend(rebuilt)
    graph.initializer.extend(new_inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    return tied


def _store_fp16(model) -> dict:
    """Store the int4 scales and the positional tables in fp16, cast back to fp32 when the session loads.

    MatMulNBits takes its scales in the activations' type (fp32 here), and fp32 scales are a fifth of a
    WikiText-103 int4 file (one per 32 weights); the per-layer positional tables (`r_table`, precomputed from
    r_net, 3-D float constants read by MatMul) are another twentieth. Both are far more precise in fp16 than the
    4-bit weights they sit beside. ONNX Runtime folds Cast(constant) into a constant when it loads the graph (on
    CPU and in the browser), so the kernels see fp32 constants and prepack as before; only the file is smaller.
    Returns {"scales": n, "positional_tables": n}."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    chosen = {}
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.input[2] in inits:
            chosen[node.input[2]] = "scales"
        elif node.op_type == "MatMul":
            for i in node.input:
                if i in inits and len(inits[i].dims) == 3 and inits[i].data_type == TensorProto.FLOAT:
                    chosen[i] = "positional_tables"
    casts, counts = {}, {"scales": 0, "positional_tables": 0}
    for name, kind in chosen.items():
        half = numpy_helper.to_array(inits[name]).astype(np.float16)
        if not np.isfinite(half).all():  # outside fp16's range: this one stays fp32
            continue
        graph.initializer.append(numpy_helper.from_array(half, name + "_fp16"))
        casts[name] = helper.make_node("Cast", [name + "_fp16"], [name + "_fp32"], name=name + "_cast",
                                       to=TensorProto.FLOAT)
        counts[kind] += 1
    rebuilt = list(casts.values())  # constants first: the graph stays in topological order
    for node in graph.node:
        for k, i in enumerate(node.input):
            if i in casts:
                node.input[k] = i + "_fp32"
        rebuilt.append(node)
    del graph.node[:]
    graph.node.extend(rebuilt)
    return counts

def check_int4_graph(model):
    """The strict checks of every export (`check_strict`), plus what they cannot see in an int4 graph.

    onnx's checker (`full_check`: types and shapes, strictly) has no schemas for com.microsoft operators and
    passes MatMulNBits and GatherBlockQuantized without looking at them, so their attributes and packed weights
    are checked here against each other; ONNX Runtime, which has the schemas, then loads and runs the graph in the
    comparison against fp32 before anything is written."""
    check_strict(model, "the int4 graph")
    inits = {t.name: t for t in model.graph.initializer}
    cast_of = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Cast" and n.input[0] in inits}
    for node in model.graph.node:
        if node.domain != "com.microsoft":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        where = f"int4 graph, {node.op_type} {node.name}"
        if attrs.get("bits") != 4 or attrs.get("block_size") not in INT4_BLOCK_SIZES:
            raise ExportError(f"{where}: bits {attrs.get('bits')} / block_size {attrs.get('block_size')}, "
                              "expected 4-bit blocks")
        if node.op_type == "MatMulNBits":
            K, N, block = attrs["K"], attrs["N"], attrs["block_size"]
            k_blocks = -(-K // block)
            want = {1: (N, k_blocks, block // 2), 2: (N * k_blocks,)}
            for idx, shape in want.items():
                t = inits.get(node.input[idx]) or inits.get(cast_of.get(node.input[idx]))
                if t is None:
                    raise ExportError(f"{where}: input {idx} ({node.input[idx]}) is not a constant")
                if int(np.prod(t.dims)) != int(np.prod(shape)):
                    raise ExportError(f"{where}: input {node.input[idx]} has shape {tuple(t.dims)}, K={K} N={N} "
                                      f"block {block} need {shape}")
            scales = numpy_helper.to_array(inits.get(node.input[2]) or inits[cast_of[node.input[2]]])
            if not np.isfinite(scales).all():
                raise ExportError(f"{where}: non-finite scales")
        elif node.op_type != "GatherBlockQuantized":
            raise ExportError(f"{where}: unexpected com.microsoft operator in an int4 graph")
