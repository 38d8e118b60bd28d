"""Static TensorRT-compatibility check of an ONNX graph, on the CPU, without TensorRT.

Run on every exported graph and by `build-engine` before it spends minutes building: it names each node TensorRT's
ONNX parser would refuse, instead of a parser error deep in a GPU build. Rules:

- every operator is in the ONNX-TensorRT parser's supported set for TensorRT 10.x and 11.x (tables below);
- no `If` / `Loop` / `Scan` / `NonZero`: TensorRT supports them, but data-dependent control flow and shapes defeat
  fixed optimization profiles and CUDA-graph capture, and our graphs are built to need none;
- no zero-size dimension in an initializer or a declared input/output/value_info shape (zero-size tensors are
  contested in TensorRT's shape machinery; our memory buffers never need one, see io_spec);
- QuantizeLinear/DequantizeLinear zero-points are constant zeros of type int8 (TensorRT quantizes symmetrically
  to INT8 only) and no `DynamicQuantizeLinear` (the ONNX Runtime CPU int8-dynamic variant is not for TensorRT);
- the default-domain opset is >= 17 (LayerNormalization, and the oldest opset our exporter emits) and no newer
  than the parser documents (MAX_OPSET);
- the nodes are in topological order: the parser imports them in file order, as the ONNX IR specifies them
  (ONNX Runtime and OpenVINO sort a graph themselves, so a file can run there and still fail to parse);
- no operator from another domain (com.microsoft contrib ops): the parser knows only the ONNX domain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx
from onnx import numpy_helper

from txl_deploy.errors import ExportError
from txl_deploy.exporters.graph_checks import first_unsorted

MIN_OPSET = 17
# The newest opset each parser documents: onnx-tensorrt docs/operators.md, "TensorRT 10.0 supports operators in the
# inclusive range of opset 9 to opset 20" (10.x as on JetPack 6, 10.3); NVIDIA's ONNX Opset Guide for TensorRT 11.x,
# "Maximum opset 25".
MAX_OPSET = {10: 20, 11: 25}

# Source: onnx/onnx-tensorrt docs/operators.md, "TensorRT 10.15 supports operators in the inclusive range of opset 9
# to opset 24" (Operator Support Matrix, rows marked Y), read 2026-11. The operators that docs/Changelog.md says
# were added after TensorRT 10.3 (JetPack 6, the oldest TensorRT we support) are left out of the 10.x set below.
_SUPPORTED_10_15 = frozenset("""
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh Attention AveragePool BatchNormalization BlackmanWindow
Cast CastLike Ceil Celu Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DeformConv
DepthToSpace DequantizeLinear Div Dropout Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather
GatherElements GatherND Gelu Gemm GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample
GroupNormalization GRU HammingWindow HannWindow HardSigmoid HardSwish Hardmax Identity If ImageScaler
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax Loop LRN LSTM
LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul Neg NonMaxSuppression
NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal RandomNormalLike RandomUniform
RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin
ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RMSNormalization RNN RoiAlign
RotaryEmbedding Round STFT ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin
Sinh Size Slice Softmax Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh TensorScatter
ThresholdedRelu Tile TopK Transpose Trilu Unsqueeze Upsample Where Xor
""".split())

# docs/Changelog.md: 10.4 added BlackmanWindow/HammingWindow/HannWindow, 10.5 real-valued STFT, 10.15 RotaryEmbedding,
# RMSNormalization and TensorScatter; Attention (opset 23) is newer than 10.3's opset 9-20 range.
_ADDED_AFTER_10_3 = frozenset(
    "BlackmanWindow HammingWindow HannWindow STFT RotaryEmbedding RMSNormalization TensorScatter Attention".split()
)

# Source for 11.x: the TensorRT 11.0 release notes (NVIDIA/TensorRT v11.0, "Parsers: Added support for Swish
# operator"; the custom TRT_* operators are not ONNX-domain ops) and the 11.5 notes (Squeeze without axes, opset 25).
# The 11.x parser removed no ONNX operator; weak typing was removed from the builder, not from the parser.
SUPPORTED_OPS = {
    10: _SUPPORTED_10_15 - _ADDED_AFTER_10_3,
    11: _SUPPORTED_10_15 | {"Swish"},
}
SOURCES = {
    10: "onnx-tensorrt docs/operators.md (TensorRT 10.15) minus the operators its Changelog lists as added after 10.3",
    11: "onnx-tensorrt docs/operators.md (TensorRT 10.15) plus Swish (TensorRT 11.0 release notes)",
}

# Supported by the parser, refused here: see the module docstring.
FORBIDDEN_OPS = {
    "If": "data-dependent control flow (breaks fixed optimization profiles and CUDA-graph capture)",
    "Loop": "data-dependent control flow (breaks fixed optimization profiles and CUDA-graph capture)",
    "Scan": "a loop over the sequence (breaks CUDA-graph capture; unroll it at export)",
    "NonZero": "output shape depends on the data (breaks fixed optimization profiles)",
    "DynamicQuantizeLinear": "dynamic quantization is the ONNX Runtime CPU int8-dynamic path; TensorRT cannot "
    "load it (export with --precision int8 for TensorRT)",
}

_INT8 = 3  # onnx.TensorProto.INT8


@dataclass(frozen=True)
class Problem:
    node: str  # node name, or the tensor / "<model>" for graph-level problems
    op: str
    why: str

    def __str__(self):
        return f"{self.node} ({self.op}): {self.why}" if self.op else f"{self.node}: {self.why}"


@dataclass
class Report:
    source: str
    trt_majors: tuple
    opset: int | None
    problems: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __bool__(self):
        return self.ok

    def __str__(self):
        majors = "/".join(f"{m}.x" for m in self.trt_majors)
        if self.ok:
            return f"{self.source}: TensorRT {majors} compatible"
        lines = [f"{self.source}: not TensorRT {majors} compatible ({len(self.problems)} problem(s)):"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)

    def raise_if_failed(self):
        if self.problems:
            shown = "; ".join(str(p) for p in self.problems[:10])
            more = f"; and {len(self.problems) - 10} more" if len(self.problems) > 10 else ""
            majors = "/".join(f"{m}.x" for m in self.trt_majors)
            raise ExportError(f"{self.source}: not TensorRT {majors} compatible: {shown}{more}")
        return self


def check_tensorrt_compat(model_or_path, trt_major: int | None = None) -> Report:
    """Check an ONNX model (a ModelProto or a path) against TensorRT `trt_major` (10 or 11; None: both)."""
    if isinstance(model_or_path, (str, Path)):
        source = str(model_or_path)
        try:
            # The external weights are not needed: initializer shapes live in the proto itself.
            model = onnx.load(str(model_or_path), load_external_data=False)
        except Exception as e:  # onnx raises DecodeError, OSError, ...: all mean "not a readable ONNX file"
            raise ExportError(f"{source}: cannot read as ONNX ({type(e).__name__}: {e})") from None
    else:
        model, source = model_or_path, model_or_path.graph.name or "<model>"
    if trt_major is None:
        majors = tuple(sorted(SUPPORTED_OPS))
    elif trt_major in SUPPORTED_OPS:
        majors = (trt_major,)
    else:
        raise ExportError(f"TensorRT {trt_major}.x: no operator table (known: {sorted(SUPPORTED_OPS)})")
    supported = frozenset.intersection(*(SUPPORTED_OPS[m] for m in majors))

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    report = Report(source, majors, opset)
    add = report.problems.append
    if opset is None or opset < MIN_OPSET:
        add(Problem("<model>", "", f"default-domain opset {opset} < {MIN_OPSET}; re-export with opset >= {MIN_OPSET}"))
    elif opset > min(MAX_OPSET[m] for m in majors):
        newest = min(MAX_OPSET[m] for m in majors)
        too_new = "/".join(f"{m}.x" for m in majors if opset > MAX_OPSET[m])
        add(Problem("<model>", "", f"default-domain opset {opset} is newer than the TensorRT {too_new} parser "
                                   f"supports ({newest}); re-export with opset {MIN_OPSET} to {newest}"))
    unsorted = first_unsorted(model.graph)
    if unsorted:
        node, index, tensor = unsorted
        add(Problem(node.name or f"<node {index}>", node.op_type,
                    f"reads {tensor!r} before the node that produces it: nodes are not in topological order, which "
                    "TensorRT's ONNX parser needs (it imports them in file order)"))
    _check_graph(model.graph, supported, majors, add)
    return report


def _check_graph(graph, supported, majors, add):
    constants = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    constants[node.output[0]] = a.t
    for t in graph.initializer:
        if any(d == 0 for d in t.dims):
            add(Problem(t.name, "initializer", f"zero-size dimension in shape {list(t.dims)}"))
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else []
        if any(d.HasField("dim_value") and d.dim_value == 0 for d in dims):
            shape = [d.dim_param or d.dim_value for d in dims]
            add(Problem(vi.name, "declared shape", f"zero-size dimension in {shape}"))

    for i, node in enumerate(graph.node):
        name = node.name or f"<node {i}: {node.op_type} -> {', '.join(node.output)}>"
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            add(Problem(name, op, f"operator of domain {node.domain!r}; TensorRT's ONNX parser knows only ONNX ops"))
        elif op in FORBIDDEN_OPS:
            add(Problem(name, op, FORBIDDEN_OPS[op]))
        elif op not in supported:
            missing = [f"{m}.x" for m in majors if op not in SUPPORTED_OPS[m]]
            add(Problem(name, op, f"not supported by the TensorRT {'/'.join(missing)} ONNX parser"))
        if op in ("QuantizeLinear", "DequantizeLinear"):
            why = _zero_point_problem(node, constants)
            if why:
                add(Problem(name, op, why))
        for a in node.attribute:  # subgraphs (already reported via If/Loop/Scan, but check what they contain)
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                _check_graph(sub, supported, majors, add)


def _zero_point_problem(node, constants):
    if len(node.input) < 3 or not node.input[2]:
        # QuantizeLinear without a zero-point quantizes to uint8 (the ONNX default), which TensorRT does not take.
        return None if node.op_type == "DequantizeLinear" else "no zero-point input: ONNX defaults to uint8; " \
            "TensorRT needs an explicit int8 zero-point of 0"
    zp = constants.get(node.input[2])
    if zp is None:
        return f"zero-point {node.input[2]!r} is not a constant; TensorRT needs constant zero-points of 0"
    if zp.data_type != _INT8:
        return f"zero-point {node.input[2]!r} is not int8 (TensorRT quantizes symmetrically to INT8)"
    if numpy_helper.to_array(zp).any():
        return f"zero-point {node.input[2]!r} is not all zeros (TensorRT supports symmetric quantization only)"
    return None
