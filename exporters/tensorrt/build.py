"""TensorRT engines from our ONNX graphs, for TensorRT 10.x (JetPack 6: 10.3) and 11.x.

Precision comes from the ONNX file. TensorRT 11 removed weak typing (no FP16/INT8 builder flags, no calibrators):
an FP16 engine is built from an FP16 graph, an INT8 engine from a graph with symmetric Q/DQ pairs, and the network
is always strongly typed. On 10.12+ we ask for a strongly typed network too (the same engine semantics on both);
older 10.x builds weakly typed and sets the FP16/INT8 builder flags the graph's precision calls for.

Every engine gets a JSON sidecar `<engine>.json` (TensorRT version, GPU, precision, profiles, model config and
vocabulary); the file format, and loading an engine, live in txl_deploy/engine_file.py, which the runtime uses too.

TensorRT API names used here are checked against TensorRT 10.3, 10.16 and 11.4 by
tests/exporters/test_tensorrt_api.py. Its conventions: TensorRT objects live in variables named builder, network,
config, parser, profile, engine, context, runtime, logger, cache, tensor, serialized; names that exist only in some
versions sit under an `if _trt_version() >= (...)` / `_trt_major()` comparison or a `hasattr(trt, ...)` check.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import onnx

from txl_deploy.contract import io_spec
from txl_deploy.contract.engine_file import (
    SIDECAR_FORMAT,
    SIDECAR_VERSION,
    gpu_info,
    import_tensorrt,
    make_logger,
    sidecar_path,
)
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.onnx_file import external_data
from txl_deploy.errors import ExportError, TxlError
from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.progress import progress_bar

# `log`, not `logger`: in this module `logger` is TensorRT's ILogger (see the naming convention above).
log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "fp16", "int8")
DEFAULT_BATCH = (1, 1, 8)


def _trt_version(trt=None) -> tuple:
    trt = trt or import_tensorrt()
    return tuple(int(x) for x in re.findall(r"\d+", trt.__version__)[:3])


def _trt_major(trt=None) -> int:
    return _trt_version(trt)[0]


# -- ranges and profiles --------------------------------------------------------------------------------------
def parse_range(text: str, what: str) -> tuple:
    """'MIN:OPT:MAX' (or one number N for N:N:N) -> (min, opt, max), with one-line errors."""
    parts = str(text).split(":")
    if len(parts) not in (1, 3):
        raise TxlError(f"--{what} {text!r}: expected MIN:OPT:MAX (e.g. 1:4:8) or a single number")
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise TxlError(f"--{what} {text!r}: MIN, OPT and MAX must be whole numbers") from None
    if len(values) == 1:
        values = values * 3
    return check_range(values, what)


def check_range(values, what: str) -> tuple:
    values = tuple(int(v) for v in values)
    if len(values) != 3:
        raise TxlError(f"--{what}: expected (min, opt, max), got {values}")
    lo, opt, hi = values
    if lo < 1:
        raise TxlError(f"--{what} {lo}:{opt}:{hi}: MIN must be >= 1 (zero-size shapes are not built)")
    if not lo <= opt <= hi:
        raise TxlError(f"--{what} {lo}:{opt}:{hi}: need MIN <= OPT <= MAX")
    return values


def profile_shapes(input_shapes: dict, batch, segment) -> dict:
    """name -> (min, opt, max) shapes for every network input.

    tokens [B, Q] and out_positions [B, P] get the batch and segment ranges (P, the positions whose log-probs are
    computed, ranges like Q but is 1 at OPT: decode asks for one position); every other input is memory state whose
    only dynamic dimension is the batch.
    """
    shapes = {}
    for name, shape in input_shapes.items():
        if name in (io_spec.TOKENS, io_spec.OUT_POSITIONS):
            if len(shape) != 2:
                raise ExportError(f"input {name!r} has shape {list(shape)}; expected [batch, segment]")
            seg = segment if name == io_spec.TOKENS else (1, 1, segment[2])
            shapes[name] = tuple((b, s) for b, s in zip(batch, seg))
            continue
        if not shape or any(d < 0 for d in shape[1:]):
            raise ExportError(f"state input {name!r} has shape {list(shape)}; only its batch dimension may be "
                              "dynamic (re-export the ONNX with txl-deploy)")
        shapes[name] = tuple((b, *shape[1:]) if shape[0] < 0 else tuple(shape) for b in batch)
    return shapes


# -- precision ----------------------------------------------------------------------------------------------------
def _has_qdq(onnx_path) -> bool:
    model = onnx.load(str(onnx_path), load_external_data=False)
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node)


def check_precision(onnx_path, info, precision: str | None, calib=None) -> str:
    """The precision to build: the ONNX's own, which a requested --fp16/--int8 must match."""
    have = info.precision
    if have == "int4":  # MatMulNBits is an ONNX Runtime contrib op: TensorRT's ONNX parser has no such operator
        raise ExportError(f"{onnx_path}: is an int4 graph (ONNX Runtime MatMulNBits), which TensorRT cannot build; "
                          "run it with ONNX Runtime, or export --precision fp16 or int8 for TensorRT")
    if precision is None:
        return have
    if precision not in PRECISIONS:
        raise TxlError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == have:
        return have
    if precision == "int8" and calib is None and not _has_qdq(onnx_path):
        raise ExportError(f"{onnx_path}: --int8 needs calibration: the graph has no QuantizeLinear/DequantizeLinear; "
                          "pass --calib FILE (text in the model's vocabulary, or a .npy of token ids)")
    hint = f"--precision {precision}" + (f" --calib {calib}" if precision == "int8" and calib else "")
    raise ExportError(
        f"{onnx_path}: is a {have} graph, but a {precision} engine was requested. TensorRT 11 takes precision from "
        f"the ONNX file: export it with `txl-deploy export CKPT --onnx {hint}` and build from that file")


# -- the build ------------------------------------------------------------------------------------------------------
def _make_progress_monitor(trt):
    """A tqdm bar per top-level build phase; None where the TensorRT build has no IProgressMonitor."""
    if not hasattr(trt, "IProgressMonitor"):
        return None

    class _TqdmProgress(trt.IProgressMonitor):
        def __init__(self):
            trt.IProgressMonitor.__init__(self)
            self._bars = {}

        def phase_start(self, phase_name, parent_phase, num_steps):
            # Nested phases (per-layer tactic timing) come and go thousands of times: show only the outer ones.
            if parent_phase is None or not self._bars:
                self._bars[phase_name] = progress_bar(total=num_steps, desc=phase_name, unit="step")

        def step_complete(self, phase_name, step):
            bar = self._bars.get(phase_name)
            if bar is not None:
                bar.update(step + 1 - bar.n)
            return True  # False would cancel the build

        def phase_finish(self, phase_name):
            bar = self._bars.pop(phase_name, None)
            if bar is not None:
                bar.close()

    return _TqdmProgress()


_OOM = re.compile(r"out of memory|outofmemory|insufficient memory|cudaErrorMemoryAllocation|"
                  r"requested amount of (gpu|device) memory|memory allocation", re.IGNORECASE)


def build_engine(onnx_path, out_path=None, precision: str | None = None, batch=DEFAULT_BATCH, segment=None,
                 timing_cache=None, workspace: int | None = None, force: bool = False, calib=None,
                 progress: bool = True) -> Path:
    """Build a TensorRT engine (and its sidecar) from an ONNX file exported by txl-deploy.

    batch, segment: (min, opt, max) ranges of the optimization profile; segment defaults to (1, 1, max_segment)
    (OPT 1: decoding one token per step is where the time goes). workspace: MiB for TensorRT's workspace pool.
    timing_cache: a file read if present and written after the build (it makes rebuilds much faster).
    """
    onnx_path = Path(onnx_path)
    info = read_onnx_info(onnx_path)  # refuses files not made by txl-deploy
    external_data(onnx_path)  # TensorRT's parser follows the data locations: only files inside the folder
    out_path = Path(out_path) if out_path is not None else onnx_path.with_suffix(".engine")
    check_writable(out_path, force)
    check_writable(sidecar_path(out_path), force)
    precision = check_precision(onnx_path, info, precision, calib)
    if info.state != "full":
        raise ExportError(f"{onnx_path}: has the {info.state!r} state layout; TensorRT engines need the 'full' "
                          "layout (TensorRT cannot update a buffer in place): export with state='full'")
    batch = check_range(batch, "batch")
    segment = check_range(segment if segment is not None else (1, 1, info.max_segment), "segment")
    if segment[2] > info.max_segment:
        raise TxlError(f"--segment max {segment[2]} exceeds the graph's max_segment {info.max_segment} "
                       "(re-export with a larger max_segment)")
    if workspace is not None and int(workspace) < 1:
        raise TxlError(f"--workspace {workspace}: must be a positive number of MiB")

    trt = import_tensorrt()
    major = _trt_major(trt)
    check_tensorrt_compat(onnx_path, trt_major=major if major in (10, 11) else None).raise_if_failed()
    gpu = gpu_info()

    errors = []  # TensorRT's error messages, for the reason of a failure
    logger = make_logger(trt, errors)
    builder = trt.Builder(logger)
    strongly_typed = _trt_version(trt) >= (10, 12)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED) if strongly_typed else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        parse_errors = [str(parser.get_error(i).desc()) for i in range(parser.num_errors)]
        raise ExportError(f"{onnx_path}: TensorRT's ONNX parser refused it: " + "; ".join(parse_errors or errors))

    config = builder.create_builder_config()
    if _trt_version(trt) < (10, 12):  # not strongly_typed; a version check for tests/exporters/test_tensorrt_api.py
        # Weakly typed: let the builder use the precision the graph was exported in.
        if precision == "fp16":
            config.set_flag(trt.BuilderFlag.FP16)
        elif precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
    if precision == "fp32" and hasattr(trt.BuilderFlag, "TF32"):
        # TF32 (on by default) rounds FP32 matmul inputs to 10 mantissa bits: an "fp32" engine should be FP32.
        config.clear_flag(trt.BuilderFlag.TF32)
    if workspace is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace) << 20)
    monitor = _make_progress_monitor(trt) if progress else None
    if monitor is not None:
        config.progress_monitor = monitor

    input_shapes = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        input_shapes[tensor.name] = tuple(tensor.shape)
    shapes = profile_shapes(input_shapes, batch, segment)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)

    cache_path = Path(timing_cache) if timing_cache is not None else None
    cache_bytes = cache_path.read_bytes() if cache_path is not None and cache_path.is_file() else b""
    cache = config.create_timing_cache(cache_bytes)
    config.set_timing_cache(cache, True)  # True: a cache from another GPU is ignored, not an error

    log.info(f"building a {precision} TensorRT {trt.__version__} engine for {gpu['name']} "
             f"(batch {':'.join(map(str, batch))}, segment {':'.join(map(str, segment))}); this takes minutes")
    try:
        serialized = builder.build_serialized_network(network, config)
    except (RuntimeError, MemoryError) as e:
        errors.append(str(e))
        serialized = None
    if serialized is None:
        why = "; ".join(errors[-3:]) or "no error message from TensorRT"
        if any(_OOM.search(m) for m in errors):
            raise ExportError(
                f"{onnx_path}: the GPU ({gpu['name']}, {gpu['memory_mib']} MiB) is too small for the requested "
                f"profile (batch max {batch[2]}, segment max {segment[2]}): lower --batch/--segment MAX or "
                f"--workspace ({why})")
        raise ExportError(f"{onnx_path}: TensorRT failed to build the engine ({why})")

    meta = {
        "format": SIDECAR_FORMAT, "format_version": SIDECAR_VERSION,
        "tensorrt_version": trt.__version__, "gpu": gpu, "precision": precision,
        "strongly_typed": strongly_typed,
        "profiles": [{name: {"min": list(lo), "opt": list(opt), "max": list(hi)}
                      for name, (lo, opt, hi) in shapes.items()}],
        "batch": list(batch), "segment": list(segment),
        "config": info.config.to_dict(), "vocab": info.vocab.to_dict() if info.vocab is not None else None,
        "export": info.export, "onnx": onnx_path.name,
    }
    # Engine and sidecar appear together or not at all.
    with atomic_path(out_path, force) as tmp_engine, atomic_path(sidecar_path(out_path), force) as tmp_meta:
        with open(tmp_engine, "wb") as f:
            f.write(memoryview(serialized))
        tmp_meta.write_text(json.dumps(meta, indent=1, sort_keys=True), encoding="utf-8")
    if cache_path is not None:
        with atomic_path(cache_path, force=True) as tmp_cache:
            tmp_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    log.info(f"wrote {out_path} ({out_path.stat().st_size / 2**20:.1f} MiB) and {sidecar_path(out_path).name}")
    return out_path
