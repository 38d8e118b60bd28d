"""An exported graph described for people (`txl-deploy info model.onnx`, `model.pte`), from its metadata (an ExecuTorch
program's sidecar) and file sizes alone."""

from __future__ import annotations

from pathlib import Path

from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.onnx_file import weight_file_bytes
from txl_deploy.contract.pte_file import read_pte_info, sidecar_path
from txl_deploy.vocab import kind_note


def describe_onnx(path) -> tuple[dict, object, int, int, str]:
    """What `txl-deploy info` shows of an exported graph, read from its metadata and file sizes alone: (the
    description, the config at the graph's mem_len, weight bytes, max_segment, precision)."""
    return _describe(path, read_onnx_info(path), weight_file_bytes(path),
                     "onnx ({precision}, {state} state)", "the file's metadata")


def describe_pte(path) -> tuple[dict, object, int, int, str]:
    """As describe_onnx, for an ExecuTorch program: read from its sidecar, which must match the program."""
    info = read_pte_info(path)
    return _describe(path, info, path.stat().st_size, "executorch ({precision}, XNNPACK, batch up to "
                     f"{info.export.get('max_batch', '?')})", f"the sidecar {sidecar_path(path).name}")


def _describe(path, info, weight_bytes: int, kind: str, vocab_source: str):
    cfg = info.config
    d = {
        "path": path, "format": kind.format(precision=info.precision, state=info.export.get("state", "incremental")),
        "config": cfg.to_dict(), "parameters": recorded_parameters(info),
        "vocab_size": len(info.vocab) if info.vocab is not None else None,
        "vocab_kind": info.vocab.kind if info.vocab is not None else None, "vocab_source": vocab_source,
        "vocab_tokenizer": info.vocab.tokenizer if info.vocab is not None else None,
        "vocab_representation": info.vocab.representation if info.vocab is not None else None,
        "memory_bytes_per_stream": {"mem_len": info.mem_len,
                                    "fp32": cfg.memory_bytes_per_stream(info.mem_len, bytes_per_value=4),
                                    "fp16": cfg.memory_bytes_per_stream(info.mem_len, bytes_per_value=2)},
        "notes": [note for note in [kind_note(info.vocab)] if note], "weight_bytes": weight_bytes,
        "max_segment": info.max_segment,
        **({"precision_report": info.export["precision_report"]} if info.export.get("precision_report") else {}),
    }
    return d, cfg.replace(mem_len=info.mem_len), weight_bytes, info.max_segment, info.precision



def recorded_parameters(info) -> int | None:
    """The model's parameter count the export recorded (as `info` counts a checkpoint's), or None: a file from
    before it was recorded, or a value that is not a count (the metadata is the file's to claim)."""
    value = info.export.get("parameters")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


LEVELS = {"word": "word-level", "char": "character-level", "bytes": "byte-level", "text8": "character-level (text8)"}


def headline(info, path) -> str:
    """The model in one line, for a page's title: what it was exported from, what it reads, how big it is, e.g.
    `kjv-char: a character-level Transformer-XL, 4 layers, 1.94M parameters, fp32`."""
    cfg = info.config
    name = info.export.get("source") or Path(path).stem
    level = f"{LEVELS.get(info.vocab.kind, info.vocab.kind)} " if info.vocab is not None else ""
    parameters = recorded_parameters(info)
    size = f", {parameters / 1e6:.3g}M parameters" if parameters else ""
    return f"{name}: a {level}Transformer-XL, {cfg.n_layer} layers{size}, {info.precision}"
