"""ONNX export: the cached step (`txl_deploy.model.cached_step.CachedTxl`) with the memory as explicit graph inputs/outputs.

One file serves decode (Q = 1) and prefill (Q up to `max_segment`) at any batch size. The graph is static apart
from the batch, segment and positions axes: a fixed `mem_len` ring buffer per layer and a per-row token counter
(see `txl_deploy.contract.io_spec`), so TensorRT profiles, CUDA graphs and Triton's implicit state all work on it.
Config, vocabulary and export settings go into `metadata_props`, so the file alone is enough to run.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import onnx

from txl_deploy import __version__
from txl_deploy.checkpoints import LoadedModel, load_model
from txl_deploy.contract.io_spec import r_table_size
from txl_deploy.contract.metadata import ExportInfo, set_onnx_props
from txl_deploy.contract.parts import KEY as PARTS_KEY
from txl_deploy.errors import ExportError, TxlError
from txl_deploy.exporters.onnx.parts import finish_parts, move_parts, parts_entry, verify_parts, write_parts
from txl_deploy.exporters.onnx.ram import drop_file_pages
from txl_deploy.exporters.onnx.trace import forget_matched_graphs, onnx_program, step_example
from txl_deploy.exporters.onnx.verify import ReferenceStream, verification_segments, verify_runtime
from txl_deploy.exporters.onnx.writing import finish, place_external_data
from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.heap import return_free_memory
from txl_deploy.runtimes import TxlRuntime

logger = logging.getLogger(__name__)

DEFAULT_OPSET = 18
# Opsets an export may use: 17 is the first with LayerNormalization; TensorRT 10.x parses opsets up to 20
# (onnx-tensorrt docs/operators.md, "opset 9 to opset 20" from 10.0 on) and 11.x up to 25 (trt_compat.MAX_OPSET).
SUPPORTED_OPSETS = range(17, 21)
DEFAULT_MAX_SEGMENT = 512


@dataclass
class ExportResult:
    path: Path
    info: ExportInfo
    verification: dict | None


def _torch_export(cached, batch: int, segment: int, positions: int, opset: int):
    args, dynamic = step_example(cached, next(cached.parameters()).dtype, batch=batch, segment=segment,
                                 positions=positions)
    return onnx_program(cached, args, cached.spec.input_names(), cached.spec.output_names(), dynamic, opset)


def export_onnx(source, out_path, *, mem_len: int | None = None, clamp_len: int | None = None,
                same_length: bool | None = None, opset: int = DEFAULT_OPSET, state: str = "incremental",
                max_segment: int = DEFAULT_MAX_SEGMENT, verify: bool = True, force: bool = False, threads: int | None = None, consume: bool = False,
                intermediate: bool = False) -> ExportResult:
    """Export `source` (a checkpoint path or a LoadedModel) to `out_path`.

    mem_len: memory length of the exported graph (default: the checkpoint's); may exceed the training memory.
    clamp_len, same_length: evaluation-time settings (default: the checkpoint's). Published scores are often
    evaluated with other values than training used (e.g. NVIDIA's WikiText-103 eval: mem_len 640, clamp_len 400,
    same_length); the graph has them built in, and the metadata records the values used.
    state: "incremental" (outputs this segment's entries; the runtimes keep the ring buffer) or "full" (outputs
    the whole next state, for Triton's implicit state and ping-pong buffers).
    verify: run ONNX Runtime against the PyTorch reference on a multi-segment stream and refuse a mismatch.
    threads: ONNX Runtime's CPU threads in that check (TxlRuntime.load); torch's are the caller's to set.
    consume: `source` is a LoadedModel the caller no longer needs; its tensors are released as soon as the export
    is done with them (a path is always consumed). Keeping them costs one more copy of the weights at the peak.
    intermediate: `out_path` is a scratch file a caller converts and removes (a reduced precision's fp32 graph):
    its path is logged at debug level only, so that a user is never told of a file that is gone afterwards.

    Memory: the model holds the checkpoint's own tensors (memory-mapped where the format allows), the weights are
    streamed into an external data file while the graph is written, and the verification runs the reference body
    over the stream before ONNX Runtime loads, keeping only its hidden states and output layer (ReferenceStream).
    Graphs under 2 GB are then rewritten into one file, one tensor at a time (`writing.finish`).
    """
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.cached_step import CachedTxl  # imports torch
    from txl_deploy.model.weights import build_model, model_parameters, weights_sha256  # imports torch

    out_path = check_writable(out_path, force)
    if opset not in SUPPORTED_OPSETS:
        lo, hi = SUPPORTED_OPSETS[0], SUPPORTED_OPSETS[-1]
        why = "LayerNormalization needs 17" if opset < lo else f"TensorRT 10.x parses opsets up to {hi}"
        raise ExportError(f"opset {opset} is not supported: choose {lo} to {hi} ({why})")
    consume = consume or not isinstance(source, LoadedModel)
    loaded = source if isinstance(source, LoadedModel) else load_model(source)
    config = loaded.config
    mem_len = export_mem_len(loaded, mem_len)
    if max_segment < 1:
        raise ExportError("max_segment must be >= 1")

    logger.info(f"loading {loaded.source_format} checkpoint {loaded.path}")
    checkpoint_settings = {"mem_len": config.mem_len, "clamp_len": config.clamp_len,
                           "same_length": config.same_length}
    overrides = {k: v for k, v in (("clamp_len", clamp_len), ("same_length", same_length)) if v is not None}
    # Evaluation-time settings change no weight shapes.
    model = build_model(config.replace(**overrides), loaded.state_dict, loaded.path).reset_length(mem_len)
    if consume:
        loaded.state_dict = {}  # the model holds the tensors now; nothing else should keep them alive
    config = model.cfg
    # Hashed before the cached step copies the output weights into its layout: the hash holds a copy of each tensor
    # in turn, the largest of them is the output weight, and the two copies at once would set the export's peak.
    weights_hash = weights_sha256(model.state_dict())
    cached = CachedTxl(model, mem_len, state=state, max_segment=max_segment).eval()
    _drop_checkpoint_pages(model)  # read once by the hash and the copies: the trace needs none of them resident
    export_meta = {
        "mem_len": mem_len, "clamp_len": config.clamp_len, "same_length": config.same_length,
        "checkpoint_settings": checkpoint_settings,
        "state": state, "max_segment": max_segment, "opset": opset, "precision": "fp32",
        "r_table_size": r_table_size(config.clamp_len, mem_len, max_segment),
        "source": os.path.basename(str(loaded.path).rstrip("/")), "source_format": loaded.source_format,
        "weights_sha256": weights_hash, "parameters": model_parameters(model),
        "txl_deploy_version": __version__, "torch_version": torch.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "io": {"inputs": [s.name for s in cached.spec.inputs()], "outputs": [s.name for s in cached.spec.outputs()]},
    }
    info = ExportInfo(config, loaded.vocab, export_meta)

    logger.info(f"exporting to ONNX (opset {opset}, mem_len {mem_len}, clamp_len {config.clamp_len}, same_length "
                f"{config.same_length}, {state} state, segments up to {max_segment})")
    try:
        with torch.no_grad():
            program = _torch_export(cached, batch=2, segment=3, positions=2, opset=opset)
    except TxlError:
        raise
    except Exception as e:
        raise ExportError(f"torch.onnx.export failed: {type(e).__name__}: {str(e).splitlines()[0]}") from e

    with atomic_path(out_path, force=force) as tmp:
        for key, value in info.to_props().items():
            program.model.metadata_props[key] = value
        # Always written with external data: the weights stream to `<name>.data` tensor by tensor instead of
        # becoming a ModelProto and then its serialised bytes (three copies of the weights at once). Every check
        # below reads the graph without the weights; graphs under protobuf's limit become one file at the end.
        program.save(str(tmp), external_data=True)
        del program
        forget_matched_graphs()
        gc.collect()
        return_free_memory()
        _drop_checkpoint_pages(model)
        if config.n_clusters > 0:  # the adaptive softmax's head and tails as graphs of their own, beside the model
            # Traced from the same cached step once the main graph's protos are gone: its output layer's tensors,
            # not copies of them (a second cached step would add its own copy of every output weight).
            part_paths = write_parts(model, cached, tmp, opset=opset)
            info.export[PARTS_KEY] = parts_entry(part_paths)  # the files the verification's runtime opens
            _write_verification(tmp, info)
        # Its own copies (folded qkv, positional tables, the output layer's weights in their layout), not the model's
        for buf in list(cached.buffers(recurse=False)) + list(cached.output_layer.buffers()):
            buf.data = torch.empty(0, dtype=buf.dtype)
        del cached
        gc.collect()
        return_free_memory()
        # Every export must stay inside what TensorRT 10.x/11.x parse (no control flow, no zero-size tensors, ...):
        # the same graph serves ONNX Runtime, TensorRT and Triton.

        check_tensorrt_compat(str(tmp)).raise_if_failed()
        logger.info("  graph checked: opset, operators and shapes fit TensorRT 10.x and 11.x")
        verification = None
        if verify:
            logger.info("verifying with ONNX Runtime against the PyTorch reference ...")
            reference = ReferenceStream(model, verification_segments(mem_len, max_segment))
            _release(model)  # the reference keeps a copy of the output layer: the weights can go before ORT loads
            del model
            # One runtime for the model and its parts: its sessions share one pool of weights, and the parts are
            # checked against the same reference stream.
            with TxlRuntime.load(tmp, threads=threads) as rt:
                verification = verify_runtime(rt, tmp, reference)
                info.verification = verification
                if verification["passed"] and PARTS_KEY in info.export:
                    info.export[PARTS_KEY]["verification"] = verify_parts(rt, reference)
            del reference
            _write_verification(tmp, info)
            if not verification["passed"]:
                raise ExportError(
                    f"verification failed: max abs difference {verification['max_abs_diff']:.3g} outside "
                    f"{verification['criterion']} (top-1 agreement {verification['top1_agreement']:.4f}); "
                    "nothing was written")
        else:
            _release(model)
            del model
        # Last, with nothing else in memory: nothing is written that a strict consumer refuses, and each file
        # becomes one protobuf where it fits (writing.finish). The parts' digests are of their final files.
        if PARTS_KEY in info.export:
            info.export[PARTS_KEY].update(finish_parts(part_paths))
            _write_verification(tmp, info)
        finish(tmp, "the exported graph")
        place_external_data(tmp, out_path, force)
        if PARTS_KEY in info.export:
            move_parts(tmp, out_path, force)
    logger.log(logging.DEBUG if intermediate else logging.INFO, f"wrote {out_path}")
    return ExportResult(out_path, info, verification)


def export_mem_len(loaded: LoadedModel, mem_len: int | None) -> int:
    """The memory length an export is made for: `mem_len`, else the checkpoint's; refused below 1."""
    chosen = int(mem_len if mem_len is not None else loaded.config.mem_len)
    if chosen <= 0:
        raise ExportError(f"{loaded.path}: the model has mem_len {loaded.config.mem_len}; pass --mem-len N (N >= 1)")
    return chosen


def _release(module) -> None:
    """Free the memory of `module`'s parameters and buffers even while other objects still refer to them.

    Deleting the module and the exported program is not enough: the traced graph and its copies refer to the very
    Parameter objects the model has (see trace.forget_matched_graphs, which runs after each graph is saved).
    Swapping each tensor's data for an empty one frees the storage; a caller's own tensors (a LoadedModel that was
    not consumed) are other tensor objects and keep theirs."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    for t in list(module.parameters()) + list(module.buffers()):
        t.data = torch.empty(0, dtype=t.dtype)
    gc.collect()  # the exported program's graph modules hold reference cycles
    return_free_memory()


def _drop_checkpoint_pages(model) -> None:
    """Take the memory-mapped checkpoint pages under `model`'s tensors out of the resident set (ram.drop_file_pages):
    the next phase reads what it needs of them again from the page cache."""
    ranges = [(t.data_ptr(), t.numel() * t.element_size()) for t in model.state_dict().values()]
    dropped = drop_file_pages(ranges)
    if dropped:
        logger.debug(f"  {dropped / 1e6:.0f} MB of memory-mapped checkpoint pages dropped from the resident set")


def _write_verification(path, info: ExportInfo):
    """Store the verification result in the file's metadata (rewriting only the protobuf, not external data)."""
    model = onnx.load(str(path), load_external_data=False)
    set_onnx_props(model, info)
    onnx.save_model(model, str(path))

