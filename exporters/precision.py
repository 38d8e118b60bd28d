"""Reduced-precision ONNX: fp16, int8 (static, symmetric Q/DQ for TensorRT) and int8-dynamic (ONNX Runtime CPU).

Every variant starts from the verified fp32 export and is checked against it with ONNX Runtime on the CPU before
it is written: a random multi-segment stream with the memory threaded through (max |log-prob difference|,
top-1 agreement) and a streaming evaluation of held-out text (the change in bits per character or perplexity).
Both go into the file's metadata (`txl_deploy.export`: `precision` and `precision_report`).

- fp16: every float tensor in FP16, the memory state included, except what measurably loses accuracy in FP16:
  the log-softmax of the adaptive softmax and everything after it run in FP32, so `log_probs` stays float32.
  LayerNormalization keeps its statistics in FP32 by its own definition (`stash_type` = 1) and ONNX Runtime's
  and TensorRT's FP16 MatMul/Softmax accumulate in FP32; `-inf` (the attention mask) is exact in FP16.
  Measured on a small trained character model (24k held-out characters): fp16 with only the log-softmax in FP32
  changed bits per character by -5e-6 relative, also keeping Softmax and LayerNormalization in FP32 by -7e-7;
  both far inside the 0.2% target, so they run in FP16 (`keep_fp32_ops` selects otherwise).
- int8: QuantizeLinear/DequantizeLinear pairs with zero-points of 0 (symmetric activations and weights,
  per-channel weights) around the MatMuls that multiply by a weight matrix, calibrated by streaming the user's
  data through the fp32 graph *with its memory*, so the activation ranges are those of steady-state inputs
  (a full ring buffer), not of a cold start. TensorRT builds int8 kernels from this (trt_compat checks it).
  The attention MatMuls (activation x activation: queries x cached keys, probabilities x values, queries x
  the positional table) stay in float: their operands' ranges change with the content of the memory.
- int8-dynamic: ONNX Runtime's dynamic MatMul quantization (per-token activation scales computed at run time,
  MatMulInteger / DynamicQuantizeLinear), the fast path on x86 VNNI/AMX and ARM64 CPUs. TensorRT cannot load it.
- int4: weight-only, block-wise 4-bit weights through ONNX Runtime's MatMulNBits (com.microsoft contrib op; see
  `quantize_int4`), for CPUs and browsers where memory and bandwidth are tight. Activations and the memory state
  stay fp32. TensorRT cannot load it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from txl_deploy.errors import ExportError, InputError, TxlError
from txl_deploy.files import atomic_path, check_writable

from .verify import REDUCED_KL

PRECISIONS = ("fp16", "int8", "int8-dynamic", "int4")
# Ops computed in FP32 in the fp16 graph (LogSoftmax with everything downstream of it): see the module docstring.
FP16_KEEP_FP32_OPS = ("LogSoftmax",)
# Tolerances of the stream comparison against the fp32 graph: the mean KL divergence KL(fp32 || reduced) in nats
# per position. Not the max abs log-prob difference: over a 267k-word vocabulary the log-probs of words with
# negligible probability move by whole units under int8 while the distribution barely changes (measured on the
# WikiText-103 base shape with random weights: int8-dynamic max abs difference 20, KL 0.07 nats, top-1 agreement
# 0.93; a trained char model: KL 5e-5). The max abs difference is recorded as well.
# Accuracy on real text is judged by the held-out evaluation, not by these.
STREAM_TOLERANCE = REDUCED_KL  # one table for export-time checks and `txl-deploy verify`
DEFAULT_MAX_CALIB_TOKENS = 32768
DEFAULT_MAX_EVAL_TOKENS = 200_000
CALIB_BATCH = 4  # the calibration text is read as this many parallel streams (each threads its own memory)


# -- token ids from the user's files ---------------------------------------------------------------------------
def read_token_ids(path, vocab, n_token: int, what: str = "calibration data") -> np.ndarray:
    """A text file (tokenized with the model's vocabulary) or a .npy of token ids -> int64 ids."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {what} not found")
    if path.suffix.lower() == ".npy":
        try:
            ids = np.load(path, allow_pickle=False)  # never unpickle user data
        except Exception as e:
            raise InputError(f"{path}: not a readable .npy of token ids ({type(e).__name__})") from None
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{path}: {what} must hold integer token ids, got dtype {ids.dtype}")
        ids = ids.reshape(-1).astype(np.int64)
    else:
        if vocab is None:
            raise InputError(f"{path}: the model has no vocabulary to tokenize text with; pass a .npy of token ids")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise InputError(f"{path}: {what} is not UTF-8 text (or pass a .npy of token ids)") from None
        ids = vocab.encode(text)
    if ids.size and (ids.min() < 0 or ids.max() >= n_token):
        bad = int(ids.min() if ids.min() < 0 else ids.max())
        raise InputError(f"{path}: token id {bad} is outside the vocabulary [0, {n_token})")
    return ids


def _segment_len(info) -> int:
    """The segment length of calibration and evaluation: the model's training segment, as far as the graph takes."""
    return max(1, min(int(info.config.tgt_len or 1), info.max_segment))


def _ids_from(data, info, what, path_hint="<array>"):
    if data is None:
        return None
    if isinstance(data, (str, Path)):
        return read_token_ids(data, info.vocab, info.config.n_token, what), str(data)
    ids = np.asarray(data).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= info.config.n_token):
        raise InputError(f"{what}: token id outside the vocabulary [0, {info.config.n_token})")
    return ids, path_hint


def _check_long_enough(ids, seg: int, name: str, what: str):
    if ids.size < seg + 1:
        raise InputError(f"{name}: {what} has {ids.size} tokens, shorter than one segment of {seg} tokens "
                         f"(+1 to predict); give more text")


# -- the conversions -------------------------------------------------------------------------------------------
def convert_fp16(model, keep_fp32_ops=FP16_KEEP_FP32_OPS):
    """fp32 ModelProto -> fp16 ModelProto: state in/out float16, log_probs float32, `keep_fp32_ops` in FP32.

    Every LogSoftmax and everything downstream of it (the adaptive softmax's cluster offsets and the Concat) stay
    in FP32 and feed `log_probs` directly, so log-probs are never rounded to fp16 on their way out."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from txl_deploy import io_spec

    from .strict import toposort

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


_FLOAT, _FLOAT16 = 1, 10  # onnx.TensorProto.FLOAT, FLOAT16
_FOLDABLE = {"Transpose", "Slice", "Concat", "Reshape", "Unsqueeze", "Squeeze", "Identity"}


def fold_weight_subgraphs(model) -> int:
    """Turn MatMul weights computed from initializers (Slice/Concat/Transpose ...) into initializers, in place.

    The adaptive softmax's head weight is a slice of the (tied) embedding with the cluster weights appended,
    transposed: the exporter emits that as nodes, so the head MatMul -- most of a WikiText-103 model's per-token
    work -- would not count as a weight MatMul and would stay in fp32. Returns the number of weights folded."""
    import onnx
    from onnx import numpy_helper

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
        _prune_dead(model)
    return folded


def _prune_dead(model):
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


class StreamingCalibration:
    """ONNX Runtime CalibrationDataReader: the calibration text streamed through the fp32 graph with its memory.

    The text is split into `batch` contiguous streams read side by side in segments of `seg` tokens; before
    each segment the reader hands the quantizer the graph's full input (tokens + the current memory), then
    advances the memory with the fp32 graph itself (the ONNX Runtime backend of TxlRuntime), so the ranges the
    calibrator sees are those of a model reading with a filled memory."""

    def __init__(self, fp32_path, ids: np.ndarray, seg: int, batch: int = CALIB_BATCH, progress=None, threads=None):
        from txl_deploy.runtimes.onnxruntime import OrtBackend

        self.backend = OrtBackend(fp32_path, providers=["cpu"], intra_op_threads=threads)
        n = ids.size // seg  # whole segments
        batch = max(1, min(batch, n))
        per_row = (n // batch) * seg
        self.streams = ids[: per_row * batch].reshape(batch, per_row)
        self.seg, self.pos = seg, 0
        self.state = self.backend.new_state(batch)
        self.positions = np.ascontiguousarray(np.broadcast_to(np.arange(seg, dtype=np.int64), (batch, seg)))
        self.n_segments = per_row // seg
        self.progress = progress

    def get_next(self):
        if self.pos > 0:  # advance the memory over the segment the quantizer just saw
            prev = self.streams[:, self.pos - self.seg:self.pos]
            self.backend.run(self.state, np.ascontiguousarray(prev), self.positions)
            if self.progress is not None:
                self.progress.update(1)
        if self.pos >= self.streams.shape[1]:
            return None
        tokens = np.ascontiguousarray(self.streams[:, self.pos:self.pos + self.seg])
        self.pos += self.seg
        feeds = {k: np.array(v, copy=True) for k, v in self.backend.state_arrays(self.state).items()}
        feeds["tokens"], feeds["out_positions"] = tokens, self.positions
        return feeds

    def close(self):
        self.backend.close()


def quantize_int8(fp32_path, out_path, calib_ids, seg: int, log=print, threads=None):
    """Static symmetric Q/DQ quantization of the weight MatMuls, calibrated by streaming `calib_ids`."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from tqdm import tqdm

    model = onnx.load(str(fp32_path), load_external_data=False)
    nodes = weight_matmuls(model)
    with tqdm(desc="calibrating", unit="segment", leave=False) as bar:
        reader = StreamingCalibration(fp32_path, calib_ids, seg, progress=bar, threads=threads)
        bar.total = reader.n_segments
        log(f"calibrating {len(nodes)} weight MatMuls on {reader.streams.size} tokens "
            f"({reader.streams.shape[0]} streams x {reader.n_segments} segments of {seg}, memory threaded through)")
        try:
            quantize_static(
                str(fp32_path), str(out_path), reader, quant_format=QuantFormat.QDQ,
                activation_type=QuantType.QInt8, weight_type=QuantType.QInt8, per_channel=True,
                op_types_to_quantize=["MatMul", "Gemm"], nodes_to_quantize=nodes,
                calibrate_method=CalibrationMethod.MinMax,
                extra_options={"ActivationSymmetric": True, "WeightSymmetric": True},
            )
        finally:
            reader.close()


def quantize_int8_dynamic(fp32_path, out_path, per_channel: bool = False):
    """ONNX Runtime dynamic int8 quantization of the weight MatMuls (MatMulInteger / DynamicQuantizeLinear)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(fp32_path), load_external_data=False)
    quantize_dynamic(str(fp32_path), str(out_path), op_types_to_quantize=["MatMul"],
                     nodes_to_quantize=weight_matmuls(model), per_channel=per_channel, weight_type=QuantType.QInt8)


# -- int4: weight-only MatMulNBits -------------------------------------------------------------------------------
# Block sizes MatMulNBits takes (powers of two from 16); 32 keeps the demo model's bits per character within 2% of
# fp32 (larger blocks are smaller files with coarser scales: 64 adds 1/16 byte less per weight than 32).
INT4_BLOCK_SIZES = (16, 32, 64, 128, 256)
INT4_DEFAULT_BLOCK = 32
# accuracy_level 4: the CPU kernels quantize each activation block to int8 and run int8 dot products (MLAS's
# VNNI / AMX / Arm dot-product paths); level 0 would dequantize the weights to fp32 for every product.
INT4_ACCURACY_LEVEL = 4


def quantize_int4(model, block_size: int = INT4_DEFAULT_BLOCK, accuracy_level: int = INT4_ACCURACY_LEVEL,
                  symmetric: bool = False, log=print) -> dict:
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
    _prune_dead(model)
    log(f"int4: {n_nbits} weight MatMuls -> MatMulNBits (block {block_size}, accuracy_level {accuracy_level}), "
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
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer


def _embedding_tables(model) -> dict:
    """Gather nodes that look up rows of a 2-D float initializer: node name -> (node, table [V, d] ndarray)."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "Gather" or node.input[0] not in inits:
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        t = inits[node.input[0]]
        if axis == 0 and len(t.dims) == 2 and t.data_type == 1:  # FLOAT
            out[node.name] = (node, numpy_helper.to_array(t))
    return out


def _find_ties(model, tables: dict, matmuls: list[str]) -> dict:
    """For each embedding table, the output-layer weights that hold its rows as columns, if they cover it.

    Returns table node name -> [(matmul output name, first weight column, n rows, first table row), ...] in table
    order. Matched on exact fp32 values, so only truly tied weights (`tie_weight`) share their blocks."""
    from onnx import numpy_helper

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
    import onnx
    from onnx import helper, numpy_helper

    _nbits_quantizer()  # the module, imported quietly
    from onnxruntime.quantization.matmul_nbits_quantizer import (DefaultWeightOnlyQuantConfig,
                                                                 DefaultWeightOnlyQuantizer)

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
        out = node.output[0] + ("_padded" if padded else "")
        nodes.append(helper.make_node("GatherBlockQuantized", [inputs[0], node.input[1], *inputs[1:]], [out],
                                      name=f"{name}_q4", domain="com.microsoft", gather_axis=0, quantize_axis=1,
                                      block_size=block_size, bits=4))
        if padded:  # the last block of each row was zero-padded to the block size
            nodes.append(helper.make_node("Slice", [out, const(f"{name}_trim_starts", [0]),
                                                    const(f"{name}_trim_ends", [d]), const(f"{name}_trim_axes", [-1])],
                                          [node.output[0]], name=f"{name}_trim"))
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
    from onnx import TensorProto, helper, numpy_helper

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
    import onnx
    from onnx import numpy_helper

    from .strict import check_strict

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


# -- checking a reduced graph against fp32 ---------------------------------------------------------------------
def compare_to_fp32(rt, rt32, batch: int = 2, seed: int = 0) -> dict:
    """Both graphs on the same random multi-segment stream (partly empty memory, decode, prefill, ring wrap)."""
    from .verify import compare_steps, verification_segments

    segments = verification_segments(rt.mem_len, rt.backend.max_segment)
    rt.reset(), rt32.reset()
    try:
        report = compare_steps(rt.step, rt32.step, rt.n_token, segments, batch, seed)
    finally:
        rt.reset(), rt32.reset()
    return {**report, "reference": "fp32 graph (ONNX Runtime CPU)"}


def evaluate_against_fp32(rt, rt32, ids: np.ndarray, seg: int, progress=True) -> dict:
    """Streaming evaluation of `ids` by both graphs: bits per character / perplexity and top-1 agreement."""
    from tqdm import tqdm

    from txl_deploy.evaluate import streaming_eval

    argmax = {}

    def stepper(runtime, key):
        def step(tokens):
            lp = runtime.step(tokens)
            argmax.setdefault(key, []).append(lp[0].argmax(-1))
            return lp
        return step

    results = {}
    for key, runtime in (("fp32", rt32), ("reduced", rt)):
        runtime.reset()
        with tqdm(total=ids.size - 1, desc=f"evaluating {key if key == 'fp32' else rt.backend.precision}",
                  unit="tok", leave=False, disable=not progress) as bar:
            results[key] = streaming_eval(ids, stepper(runtime, key), seg, progress=bar.update)
        runtime.reset()
    agree = float(np.mean(np.concatenate(argmax["reduced"]) == np.concatenate(argmax["fp32"])))
    return {"fp32": results["fp32"], "reduced": results["reduced"], "top1_agreement": agree}


def accuracy_report(evaluation: dict, kind: str) -> dict:
    """The headline numbers: bits per character for character vocabularies, perplexity otherwise."""
    metric = "bits_per_character" if kind == "char" else "perplexity"
    key = "bits_per_token" if kind == "char" else "perplexity"
    base, new = evaluation["fp32"][key], evaluation["reduced"][key]
    return {"metric": metric, "fp32": base, "reduced": new, "relative_change": (new - base) / base,
            "top1_agreement": evaluation["top1_agreement"], "tokens": evaluation["fp32"]["n_tokens"]}


# -- the entry points --------------------------------------------------------------------------------------------
def reduce_onnx(fp32_path, out_path, *, precision: str, calib=None, eval_data=None, verify: bool = True,
                force: bool = False, max_calib_tokens: int = DEFAULT_MAX_CALIB_TOKENS,
                max_eval_tokens: int = DEFAULT_MAX_EVAL_TOKENS, keep_fp32_ops=FP16_KEEP_FP32_OPS,
                dynamic_per_channel: bool = False, int4_block_size: int = INT4_DEFAULT_BLOCK,
                int4_accuracy_level: int = INT4_ACCURACY_LEVEL, log=print, threads: int | None = None):
    """Convert a txl-deploy fp32 ONNX file to `precision`, check it against the fp32 graph, write it atomically.

    calib: calibration data for int8 (a text file, a .npy of token ids, or an array of ids).
    eval_data: held-out data for the accuracy change (same kinds) [default: the calibration data];
    without either, only the random-stream comparison is made (and recorded).
    verify: refuse the result (write nothing) when the stream comparison exceeds STREAM_TOLERANCE.
    threads: ONNX Runtime's CPU threads for the calibration reader and the checks (quantize_static's calibrator
    opens its own session, at ONNX Runtime's default threads: its API takes no session options).
    int4_block_size, int4_accuracy_level: MatMulNBits settings of --precision int4 (see quantize_int4).
    Returns the ExportResult of the written file.
    """
    import onnx

    from txl_deploy.metadata import read_onnx_info, set_onnx_props
    from txl_deploy.runtimes import TxlRuntime

    from .onnx import ExportResult, place_external_data, save_checked
    from .strict import toposort
    from .trt_compat import check_tensorrt_compat

    out_path = Path(out_path)
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    check_writable(out_path, force)
    if precision == "int4" and int4_block_size not in INT4_BLOCK_SIZES:
        raise InputError(f"int4 block size {int4_block_size}: expected one of "
                         f"{', '.join(map(str, INT4_BLOCK_SIZES))}")
    info = read_onnx_info(fp32_path)
    if info.precision != "fp32":
        raise ExportError(f"{fp32_path}: is a {info.precision} graph; reduced precision starts from an fp32 export")
    seg = _segment_len(info)
    calib_ids = _ids_from(calib, info, "calibration data")
    if precision == "int8":
        if calib_ids is None:
            raise InputError("--precision int8 needs calibration data: pass --calib FILE (text in the model's "
                             "vocabulary, or a .npy of token ids) that the model will read with its memory")
        _check_long_enough(calib_ids[0], seg, calib_ids[1], "calibration data")
    eval_ids = _ids_from(eval_data, info, "evaluation text") if eval_data is not None else calib_ids
    if eval_ids is not None:
        _check_long_enough(eval_ids[0], seg, eval_ids[1], "evaluation text")

    with tempfile.TemporaryDirectory(prefix="txl-precision-") as work:
        work = Path(work)
        converted = work / "converted.onnx"
        source, int4_method = fp32_path, None
        if precision in ("int8", "int8-dynamic"):
            model = onnx.load(str(fp32_path))
            if fold_weight_subgraphs(model):  # quantize the adaptive-softmax head too
                source = work / "folded.onnx"
                onnx.save_model(model, str(source), save_as_external_data=model.ByteSize() > 2**31 - 2**26)
            del model
        log(f"converting to {precision} ...")
        try:
            if precision == "fp16":
                model = onnx.load(str(fp32_path))
                model = convert_fp16(model, keep_fp32_ops)
                onnx.save_model(model, str(converted))
            elif precision == "int8":
                quantize_int8(source, converted, calib_ids[0][:max_calib_tokens], seg, log=log, threads=threads)
            elif precision == "int4":
                model = onnx.load(str(fp32_path))
                fold_weight_subgraphs(model)  # the adaptive-softmax head weight becomes a constant to quantize
                int4_method = quantize_int4(model, int4_block_size, int4_accuracy_level, log=log)
                check_int4_graph(model)
                onnx.save_model(model, str(converted))
            else:
                quantize_int8_dynamic(source, converted, per_channel=dynamic_per_channel)
        except TxlError:
            raise
        except Exception as e:
            raise ExportError(f"{precision} conversion failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e

        model = onnx.load(str(converted))
        toposort(model.graph)  # TensorRT's parser reads nodes in file order; conversion passes may append nodes
        info.export = {**info.export, "precision": precision}
        trt = check_tensorrt_compat(model)
        if precision == "int8":
            trt.raise_if_failed()  # the static int8 graph exists for TensorRT: refuse one it cannot build
        set_onnx_props(model, info)
        onnx.save_model(model, str(converted))

        with TxlRuntime.load(converted, providers=["cpu"], threads=threads) as rt, \
                TxlRuntime.load(fp32_path, providers=["cpu"], threads=threads) as r32:
            log("comparing with the fp32 graph on a multi-segment stream ...")
            stream = compare_to_fp32(rt, r32)
            tol = STREAM_TOLERANCE[precision]
            stream.update(tolerance=tol, precision=precision, passed=bool(stream["kl_divergence"] <= tol))
            log(f"  KL divergence from fp32 {stream['kl_divergence']:.3g} nats/position (tolerance {tol:g}), max abs "
                f"log-prob difference {stream['max_abs_diff']:.3g}, top-1 agreement "
                f"{stream['top1_agreement']:.4f} over {stream['tokens']} positions -> "
                f"{'OK' if stream['passed'] else 'MISMATCH'}")
            accuracy = None
            if eval_ids is not None:
                ids = eval_ids[0][:max_eval_tokens]
                accuracy = accuracy_report(evaluate_against_fp32(rt, r32, ids, seg),
                                           info.vocab.kind if info.vocab is not None else "word")
                accuracy["data"] = Path(eval_ids[1]).name
                name = "bits per character" if accuracy["metric"] == "bits_per_character" else "perplexity"
                log(f"  {name} on {accuracy['tokens']} held-out tokens: fp32 {accuracy['fp32']:.4f}, {precision} "
                    f"{accuracy['reduced']:.4f} ({100 * accuracy['relative_change']:+.3f}%), top-1 agreement "
                    f"{accuracy['top1_agreement']:.4f}")
        if verify and not stream["passed"]:
            raise ExportError(
                f"{precision} graph disagrees with fp32: KL divergence {stream['kl_divergence']:.3g} nats/position > "
                f"{stream['tolerance']:g} (top-1 agreement {stream['top1_agreement']:.4f}); nothing was written")

        report = {"precision": precision, "stream": stream, "accuracy": accuracy,
                  "tensorrt_ready": trt.ok,
                  "tensorrt_problems": [str(p) for p in trt.problems[:5]],
                  "method": int4_method or _method(precision, keep_fp32_ops, calib_ids, max_calib_tokens, seg,
                                                   dynamic_per_channel)}
        if not trt.ok:
            log(f"  not TensorRT-ready ({len(trt.problems)} problem(s), e.g. {trt.problems[0]}): "
                f"{'ONNX Runtime only' if precision in ('int8-dynamic', 'int4') else 'see the report'}")
        info.export["precision_report"] = report
        info.verification = stream
        set_onnx_props(model, info)
        with atomic_path(out_path, force=force) as tmp:
            save_checked(model, tmp, f"the {precision} graph")  # last: refuses what a strict consumer refuses
            place_external_data(tmp, out_path, force)
    log(f"wrote {out_path}")
    return ExportResult(out_path, info, stream)


def _method(precision, keep_fp32_ops, calib_ids, max_calib_tokens, seg, per_channel) -> dict:
    if precision == "fp16":
        return {"fp32_ops": list(keep_fp32_ops), "state_dtype": "float16", "log_probs_dtype": "float32"}
    if precision == "int8":
        return {"format": "QDQ", "symmetric": True, "per_channel_weights": True, "calibration": "MinMax",
                "ops": "weight MatMuls", "calibration_tokens": int(min(calib_ids[0].size, max_calib_tokens)),
                "calibration_data": Path(calib_ids[1]).name, "segment": seg, "memory_threaded": True}
    return {"format": "dynamic (MatMulInteger)", "ops": "weight MatMuls", "per_channel_weights": per_channel}


def export_reduced(source, out_path, *, precision: str, calib=None, eval_text=None, mem_len=None, opset: int = 18,
                   state: str = "incremental", max_segment: int = 512, verify: bool = True, force: bool = False,
                   log=print, clamp_len=None, same_length=None, consume: bool = False, **options):
    """`txl-deploy export --precision fp16|int8|int8-dynamic`: export fp32 (verified against PyTorch if `verify`),
    convert, check against fp32, write `out_path` atomically. `source`: a checkpoint path or a LoadedModel
    (`consume`: as in export_onnx)."""
    from txl_deploy.checkpoints import LoadedModel, load_model

    from .onnx import export_onnx

    out_path = Path(out_path)
    if precision not in PRECISIONS:
        raise InputError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)} (or fp32)")
    check_writable(out_path, force)
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    # Check the user's data before the (minutes-long for big models) fp32 export.
    cfg = loaded.config
    seg = max(1, min(int(cfg.tgt_len or 1), max_segment))
    if precision == "int8" and calib is None:
        raise InputError("--precision int8 needs calibration data: pass --calib FILE (text in the model's "
                         "vocabulary, or a .npy of token ids) that the model will read with its memory")
    for data, what in ((calib, "calibration data"), (eval_text, "evaluation text")):
        if isinstance(data, (str, Path)):
            _check_long_enough(read_token_ids(data, loaded.vocab, cfg.n_token, what), seg, str(data), what)
    with tempfile.TemporaryDirectory(prefix="txl-export-", dir=out_path.parent if out_path.parent.exists() else None) \
            as work:
        fp32 = Path(work) / "fp32.onnx"
        export_onnx(loaded, fp32, mem_len=mem_len, clamp_len=clamp_len, same_length=same_length, opset=opset,
                    state=state, max_segment=max_segment, verify=verify, force=True, log=log,
                    threads=options.get("threads"), consume=consume or not isinstance(source, LoadedModel))
        return reduce_onnx(fp32, out_path, precision=precision, calib=calib, eval_data=eval_text, verify=verify,
                           force=force, log=log, **options)


__all__ = ["PRECISIONS", "export_reduced", "reduce_onnx", "read_token_ids", "convert_fp16"]
