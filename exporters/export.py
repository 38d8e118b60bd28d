"""From a checkpoint to a verified graph at any precision (`txl-deploy export`): the checkpoint is read once, the
memory the export will need is checked against what the machine has before anything long starts, then the fp32
graph is exported (and verified), and converted when a reduced precision is asked for; `ort_format` adds the ONNX
Runtime format (`.ort`) of the result, for ONNX Runtime's minimal builds. `executorch` writes an ExecuTorch program
(`.pte` and its sidecar) instead of a graph, for phones."""

from __future__ import annotations

from pathlib import Path

from txl_deploy.checkpoints import load_model
from txl_deploy.errors import InputError
from txl_deploy.exporters.executorch.export import PRECISIONS as EXECUTORCH_PRECISIONS
from txl_deploy.exporters.executorch.export import export_executorch
from txl_deploy.exporters.onnx.export import DEFAULT_OPSET, ExportResult, export_onnx
from txl_deploy.exporters.onnx.ort_format import check_ort_format_writable, write_ort_format
from txl_deploy.exporters.onnx.ram import check_export_fits, export_peaks, loaded_weight_bytes
from txl_deploy.exporters.precision.convert import export_reduced


def export_checkpoint(checkpoint, output=None, *, precision: str = "fp32", vocab=None, vocab_kind: str | None = None,
                      config=None, preset: str | None = None, check_memory: bool = True,
                      mem_len: int | None = None, max_segment: int = 512, verify: bool = True,
                      threads: int | None = None, block_size: int | None = None, calib=None, eval_text=None,
                      tokenizer: str | None = None, representation: str | None = None, ort_format: bool = False,
                      executorch: bool = False,
                      **graph_options) -> ExportResult:
    """Export `checkpoint` (any supported format) to `output` [default: the checkpoint's name + .onnx, or + .pte
    with `executorch`].

    vocab, vocab_kind, config, preset, tokenizer, representation: how the checkpoint is read (see `load_model`); the
    tokenizer and an events vocabulary's music representation are stored with the vocabulary in the graph's
    metadata.
    graph_options: clamp_len, same_length, opset, state, force (see export_onnx). block_size: int4 only.
    threads: torch's threads for the trace and the reference, ONNX Runtime's for the checks.
    ort_format: also write `<name>.ort` and `<name>.required_operators.config` beside the graph (any precision),
    checked to give the graph's log-probs bit for bit (see exporters/onnx/ort_format.py)."""
    if block_size is not None and precision != "int4":
        raise InputError(f"--block-size is for --precision int4, not {precision}")
    if executorch:
        _check_executorch_options(precision, block_size, calib, ort_format, graph_options)
    suffix = ".pte" if executorch else ".onnx"
    out = Path(output) if output else Path(Path(checkpoint).name.split(".")[0] + suffix)
    if ort_format:  # refused now, not after a long export
        check_ort_format_writable(out, graph_options.get("force", False))
    if threads:
        import torch  # the export trace and the PyTorch reference of the verification

        torch.set_num_threads(threads)
    how = {"vocab": vocab, "vocab_kind": vocab_kind, "config": config, "preset": preset, "tokenizer": tokenizer,
           "representation": representation}
    loaded = load_model(checkpoint, **{k: v for k, v in how.items() if v is not None})
    if check_memory:
        cfg = loaded.config
        check_export_fits(export_peaks(cfg, loaded_weight_bytes(loaded), mem_len or cfg.mem_len, max_segment), verify)
    if executorch:
        return export_executorch(loaded, out, precision=precision, mem_len=mem_len, max_segment=max_segment,
                                 eval_text=eval_text, verify=verify, threads=threads, consume=True,
                                 **{k: v for k, v in graph_options.items() if k in ("clamp_len", "same_length", "force")})
    if precision == "fp32":
        result = export_onnx(loaded, out, mem_len=mem_len, max_segment=max_segment, verify=verify, threads=threads,
                             consume=True, **graph_options)
    else:
        options = {"int4_block_size": block_size} if block_size is not None else {}
        result = export_reduced(loaded, out, precision=precision, calib=calib, eval_text=eval_text, mem_len=mem_len,
                                max_segment=max_segment, verify=verify, threads=threads, consume=True,
                                **graph_options, **options)
    if ort_format:
        write_ort_format(result.path, force=graph_options.get("force", False), threads=threads)
    return result


def _check_executorch_options(precision, block_size, calib, ort_format, graph_options) -> None:
    """Options of the ONNX export that an ExecuTorch program has no use for: refused, never silently ignored."""
    if precision not in EXECUTORCH_PRECISIONS:
        raise InputError(f"--precision {precision} is not available with --executorch: choose "
                         f"{', '.join(EXECUTORCH_PRECISIONS)}")
    if block_size is not None:
        raise InputError("--block-size is for ONNX int4 graphs; --executorch int4 uses groups of 32")
    if calib is not None:
        raise InputError("--calib is for the ONNX int8 graph; --executorch int8 quantizes activations at run time")
    if ort_format:
        raise InputError("--ort-format is for ONNX graphs, not --executorch")
    if graph_options.get("state", "incremental") != "incremental":
        raise InputError("--executorch programs have the incremental layout only (the app keeps the ring buffer)")
    if graph_options.get("opset", DEFAULT_OPSET) != DEFAULT_OPSET:
        raise InputError("--opset is for ONNX graphs, not --executorch")
