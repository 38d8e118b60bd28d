"""The ONNX Runtime format (`.ort`) of a verified graph, for ONNX Runtime's minimal and custom builds (phones).

ONNX Runtime's own converter (`python -m onnxruntime.tools.convert_onnx_models_to_ort`) writes `<name>.ort` and the
operators a custom build must include, `<name>.required_operators.config` (the converter names them
`<name>.extended.ort` and `<name>.required_operators.extended.config`, after the optimization level; they are
renamed to the plain names, which the converter itself uses at its default level).

The optimizations are saved at the `extended` level in the `Fixed` style: the graph is fused once, here, into
standard ONNX operators and ONNX Runtime's CPU contrib operators (com.microsoft), which every build that lists them in
its config runs. A minimal build cannot optimize a graph at load time, so what is saved is what it runs. The `all`
level adds the layout transformers, which bake in the converting machine's hardware (NCHWc on x86-64; the converter
leaves it out for any target but x86-64). No `--target_platform arm`: it fuses int8 (QDQ) graphs for signed 8-bit
weights and activations, whose numbers differ from the .onnx's (max abs log-prob difference 1.26 on the tiny model),
so the check below could not pass; the default fuses them as ONNX Runtime does the .onnx.

The `.ort` is checked before it is written: through `TxlRuntime.load`, on the verification stream (several segments,
batch 2, the ring wrapping), its log-probs must equal the `.onnx`'s bit for bit.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from txl_deploy.contract.onnx_file import external_data, weight_file_bytes
from txl_deploy.errors import ExportError
from txl_deploy.exporters.onnx.ram import log_prob_budget
from txl_deploy.exporters.onnx.stream import stream_tokens, verification_segments
from txl_deploy.exporters.onnx.verify import runtime_step
from txl_deploy.files import atomic_path, check_writable
from txl_deploy.runtimes import TxlRuntime

logger = logging.getLogger(__name__)

OPTIMIZATION_LEVEL = "extended"
CONFIG_SUFFIX = ".required_operators.config"
# flatbuffers address 32-bit offsets: an .ort holds its weights inline, under 2 GB.
ORT_FORMAT_MAX_BYTES = 2_000_000_000
CONVERT_TIMEOUT_S = 3600


@dataclass
class OrtFormatResult:
    path: Path  # the .ort
    config: Path  # its required-operators config
    verification: dict


def ort_format_paths(onnx_path) -> tuple[Path, Path]:
    """Where `--ort-format` writes beside `onnx_path`: `<name>.ort` and `<name>.required_operators.config`."""
    onnx_path = Path(onnx_path)
    stem = onnx_path.with_suffix("")
    return stem.with_name(stem.name + ".ort"), stem.with_name(stem.name + CONFIG_SUFFIX)


def check_ort_format_writable(onnx_path, force: bool = False) -> None:
    """Refuse before the export starts when an .ort or its config exists and `force` is not given."""
    for path in ort_format_paths(onnx_path):
        check_writable(path, force)


def write_ort_format(onnx_path, *, force: bool = False, threads: int | None = None) -> OrtFormatResult:
    """Convert the verified graph at `onnx_path` to `<name>.ort` + `<name>.required_operators.config` beside it,
    both written atomically, only once the .ort gives the .onnx's log-probs exactly (ExportError otherwise)."""
    onnx_path = Path(onnx_path)
    ort_path, config_path = ort_format_paths(onnx_path)
    check_ort_format_writable(onnx_path, force)
    if external_data(onnx_path) or onnx_path.stat().st_size > ORT_FORMAT_MAX_BYTES:
        raise ExportError(f"{onnx_path}: the ONNX Runtime format holds its weights inline, under 2 GB; this graph "
                          "is larger (export without --ort-format)")
    logger.info(f"converting to the ONNX Runtime format ({OPTIMIZATION_LEVEL} optimizations) ...")
    with atomic_path(ort_path, force=force) as tmp_ort, atomic_path(config_path, force=force) as tmp_config:
        converted, config = _convert(onnx_path, tmp_ort.parent)
        os.replace(converted, tmp_ort)
        os.replace(config, tmp_config)
        verification = compare_ort_format(onnx_path, tmp_ort, threads=threads)
        if not verification["passed"]:
            raise ExportError(f"{ort_path.name}: its log-probs differ from {onnx_path.name}'s (max abs difference "
                              f"{verification['max_abs_diff']:.3g}); nothing was written")
    logger.info(f"  {ort_path.name}: log-probs identical to {onnx_path.name} over {verification['tokens']} "
                f"positions (batch {verification['batch']}, segments {verification['segments']})")
    logger.info(f"wrote {ort_path} ({ort_path.stat().st_size / 1e6:.1f} MB) and {config_path.name}")
    return OrtFormatResult(ort_path, config_path, verification)


def _convert(onnx_path: Path, work_dir: Path) -> tuple[Path, Path]:
    """Run ONNX Runtime's converter on a copy of the graph in `work_dir`; returns (the .ort, its config)."""
    # A folder of its own: the converter converts every .onnx of a folder, and names its outputs after the level.
    src_dir = Path(tempfile.mkdtemp(prefix="convert.", dir=work_dir))
    src = src_dir / onnx_path.name
    shutil.copyfile(onnx_path, src)
    # The model first: --optimization_style takes one or more values and would swallow it.
    command = [sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(src), "--optimization_style",
               "Fixed"]
    # A process of its own: the converter prints, and takes its level from the environment.
    env = {**os.environ, "ORT_CONVERT_ONNX_MODELS_TO_ORT_OPTIMIZATION_LEVEL": OPTIMIZATION_LEVEL}
    try:
        done = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ExportError(f"ONNX Runtime's converter did not finish in {CONVERT_TIMEOUT_S} s") from None
    for line in done.stdout.splitlines():
        logger.debug(f"  converter: {line}")
    converted = src.with_suffix(f".{OPTIMIZATION_LEVEL}.ort")
    config = src.with_suffix(f".required_operators.{OPTIMIZATION_LEVEL}.config")
    if done.returncode != 0 or not converted.is_file() or not config.is_file():
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        why = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
        raise ExportError(f"ONNX Runtime's converter failed on {onnx_path.name}: {why.strip()[:200]}")
    return converted, config


def compare_ort_format(onnx_path, ort_path, threads: int | None = None, batch: int = 2, seed: int = 0) -> dict:
    """Feed the verification stream to the .onnx and the .ort (both through TxlRuntime, on the CPU) and compare their
    log-probs; `passed` only when they are equal bit for bit."""
    load = {"backend": "onnxruntime", "threads": threads, "providers": ["cpu"]}
    with TxlRuntime.load(onnx_path, **load) as onnx_rt, TxlRuntime.load(ort_path, **load) as ort_rt:
        segments = verification_segments(onnx_rt.mem_len, onnx_rt.backend.max_segment)
        tokens = stream_tokens(onnx_rt.n_token, segments, batch, seed)
        budget = log_prob_budget(weight_file_bytes(onnx_path))
        steps = [runtime_step(onnx_rt, budget), runtime_step(ort_rt, budget)]
        worst, identical, pos = 0.0, True, 0
        for q in segments:
            seg = tokens[:, pos:pos + q]
            want, got = (_blocks(step(seg), q) for step in steps)
            for a, b in zip(want, got):
                identical = identical and np.array_equal(a, b)
                worst = max(worst, float(np.max(np.abs(a.astype(np.float64) - b))))
            pos += q
    return {"passed": bool(identical), "max_abs_diff": worst, "criterion": "bit-for-bit equal log-probs",
            "tokens": batch * sum(segments), "batch": batch, "segments": segments}


def _blocks(out, q: int):
    """A segment's log-probs as the runtime gave them: the whole [B, Q, V] array, or PositionBlocks block by block."""
    if not callable(out):
        yield np.asarray(out)
        return
    for lo in range(0, q, out.block):
        yield np.asarray(out(lo, min(q, lo + out.block)))
