"""`run_benchmark`: the measurements behind `txl-deploy bench`, as a function returning the JSON report: per
(mem_len, batch), the backend under test and the PyTorch eager reference (`EagerAtPositions`) in one process on one
token stream, interleaved, with optional extra sides (eager as written, another graph to `compare`). What each
side runs: docs/benchmarks.md ("`txl-deploy bench`")."""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import platform
import sys
import tempfile

import numpy

from txl_deploy import __version__
from txl_deploy.bench import timing as measure
from txl_deploy.bench.bandwidth_floor import BandwidthProbe
from txl_deploy.bench.bandwidth_floor import floor as floor_of
from txl_deploy.bench.op_profile import profile_decode
from txl_deploy.bench.runners import mem_lens_for, opener, resolve
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.errors import InputError
from txl_deploy.progress import progress_bar

logger = logging.getLogger(__name__)


def machine_info() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "gpu": None}
    try:
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def versions() -> dict:
    out = {"python": sys.version.split()[0], "numpy": numpy.__version__, "txl_deploy": __version__}
    for name in ("onnxruntime", "torch", "tensorrt"):
        try:
            out[name] = __import__(name).__version__
        except Exception:
            out[name] = None
    return out


def report_header(schema: str, **more_versions) -> dict:
    """What every benchmark report opens with: its schema, when, on what machine, with which versions."""
    return {"schema": schema, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(), "versions": {**versions(), **more_versions}}


def versions_text(v: dict, names=("python", "numpy", "onnxruntime", "txl_deploy")) -> str:
    """"python 3.12.3, numpy 2.1.0, ...": a report's versions as its results file says them."""
    return ", ".join(f"{n.replace('_', '-')} {v.get(n)}" for n in names)


def _cache(cache_dir):
    """The folder for stand-ins and exports: `cache_dir`, else a temporary one removed afterwards."""
    if cache_dir is not None:
        os.makedirs(cache_dir, exist_ok=True)
        return contextlib.nullcontext(cache_dir)
    return tempfile.TemporaryDirectory(prefix="txl-bench-", ignore_cleanup_errors=True)


def _cuda_device(backend: str, device: str):
    if backend in ("torch", "torch-fast") and device.startswith("cuda"):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        return torch.device(device)
    return None


def run_benchmark(model: str, *, backend: str | None = None, baseline: str = "eager", batches=(1,),
                  mem_lens=None, prompt_len: int = 512, gen_len: int = 128, warmup: int = 2, repeat: int = 3,
                  device: str = "cpu", threads: int | None = None, providers=None, state: str = "incremental",
                  reference=None, cache_dir=None, seed: int = 0, floor: bool = True, profile: bool = False,
                  as_written_batches=(), compare=None, progress: bool = True) -> dict:
    if baseline not in ("eager", "none"):
        raise InputError(f"baseline must be 'eager' or 'none', got {baseline!r}")
    if gen_len < 1 or prompt_len < 1 or repeat < 1 or warmup < 0:
        raise InputError("gen-len, prompt-len and repeat must be >= 1, warmup >= 0")

    with _cache(cache_dir) as cache:
        source = resolve(model, reference=reference, cache_dir=cache)
        backend = backend or source.default_backend
        if baseline == "eager" and source.checkpoint is None:
            raise InputError(f"{source.path}: the eager baseline needs the checkpoint it was exported from; pass "
                             "--reference CHECKPOINT, or --baseline none")
        mem_lens = mem_lens_for(source, mem_lens)
        configs = [(m, b) for m in mem_lens for b in batches]
        kw = dict(device=device, threads=threads, state=state, cache_dir=cache)
        # Export (or build) every candidate before timing anything: exports are minutes and would skew nothing,
        # but a progress bar that stalls on them would mislead.
        openers = {m: opener(source, backend, m, providers=providers, **kw) for m in mem_lens}
        compare_opener, compare_mem_len = None, None
        if compare is not None:
            if backend != "onnxruntime":
                raise InputError("--compare runs another .onnx file: it needs the onnxruntime backend")
            compare_source = resolve(str(compare), cache_dir=cache)
            if compare_source.kind != "onnx" or compare_source.fixed_mem_len not in mem_lens:
                raise InputError(f"{compare}: --compare needs an .onnx file of the same memory length "
                                 f"({', '.join(map(str, mem_lens))})")
            compare_mem_len = compare_source.fixed_mem_len
            compare_opener = opener(compare_source, backend, compare_mem_len, providers=providers, **kw)
        bandwidth_probe = None
        if floor and not device.startswith("cuda") and backend in ("onnxruntime", "torch-fast"):
            bandwidth_probe = BandwidthProbe()  # measured in every round, between the sides' turns
        as_written_batches = set(as_written_batches or ()) if baseline == "eager" else set()
        n_sides = sum(1 + (baseline == "eager") + (m == compare_mem_len) + (b in as_written_batches)
                      for m, b in configs)
        bar = progress_bar(total=n_sides * (repeat + 1), desc="bench", unit="phase", enabled=progress)
        results = []
        config = None
        for mem_len, batch in configs:
            sides = [measure.Side("candidate", openers[mem_len], _cuda_device(backend, device))]
            if baseline == "eager":
                sides.append(measure.Side("baseline", opener(source, "eager", mem_len, **kw),
                                          _cuda_device("torch", device)))
            if compare_opener is not None and mem_len == compare_mem_len:
                sides.append(measure.Side("compare", compare_opener))
            if batch in as_written_batches:
                sides.append(measure.Side("eager_as_written", opener(source, "eager-as-written", mem_len, **kw),
                                          _cuda_device("torch", device), prefill_only=True))
            probe = measure.open_side(sides[0])
            config, n_token, table_size = probe.config, probe.n_token, _table_size(probe)
            precision = getattr(probe.backend, "precision", "fp32")
            stream = measure.make_stream(n_token, batch, mem_len, gen_len, prompt_len, seed)
            bar.set_postfix_str(f"mem_len {mem_len} batch {batch}")
            probed = measure.run_pair(sides, stream, repeat, warmup, progress=bar.update, probe=bandwidth_probe)
            res = {"mem_len": mem_len, "batch": batch,
                   "sides": {s.label: {"backend": _backend_name(s.label, backend, compare, precision),
                                       **measure.summarise(s, stream)} for s in sides},
                   "speedup": None, "parity": None}
            by_label = {s.label: s for s in sides}
            c = res["sides"]["candidate"]
            if baseline == "eager":
                b = res["sides"]["baseline"]
                res["speedup"] = {"decode_p50": b["decode_ms"]["p50"] / c["decode_ms"]["p50"],
                                  "decode_tokens_per_s": c["decode_tokens_per_s"] / b["decode_tokens_per_s"],
                                  "prefill": b["prefill_ms"] / c["prefill_ms"]}
                res["parity"] = measure.parity(by_label["candidate"], by_label["baseline"])
                if "eager_as_written" in res["sides"]:
                    res["speedup"]["prefill_vs_as_written"] = (res["sides"]["eager_as_written"]["prefill_ms"]
                                                               / c["prefill_ms"])
                    # the same model: its full-sequence output layer at the last position equals the baseline's
                    res["as_written_parity"] = measure.parity(by_label["eager_as_written"], by_label["baseline"])
            if "compare" in res["sides"]:
                o = res["sides"]["compare"]
                res["speedup_vs_compare"] = {"decode_p50": o["decode_ms"]["p50"] / c["decode_ms"]["p50"],
                                             "prefill": o["prefill_ms"] / c["prefill_ms"]}
                res["compare_parity"] = measure.parity(by_label["candidate"], by_label["compare"])
            if probed:
                copies = [bw.copy for bw in probed]
                rounds = list(zip(copies, measure.decode_rounds_ms(by_label["candidate"], repeat)))
                res["floor"] = floor_of(config, mem_len, batch, float(numpy.median(copies)),
                                        c["decode_ms"]["p50"], table_size, precision, rounds=rounds,
                                        read_rounds=[bw.read for bw in probed])
            if profile and backend == "onnxruntime":
                res["profile"] = _profile(sides[0], stream, threads, providers, device)
            results.append(res)
        bar.close()
    return {
        **report_header("txl-deploy-bench/1"), "model": str(model), "source": source.kind,
        "settings": {"backend": backend, "baseline": baseline, "device": device, "threads": threads,
                     "prompt_len": prompt_len, "gen_len": gen_len, "warmup": warmup, "repeat": repeat, "seed": seed,
                     "state": state, "as_written_batches": sorted(as_written_batches),
                     "compare": None if compare is None else str(compare)},
        "config": config.to_dict() if config is not None else None,
        "results": results,
    }


def _backend_name(label, backend, compare=None, precision="fp32"):
    if label == "candidate":
        return backend if precision == "fp32" else f"{backend} ({precision})"
    if label == "compare":
        return f"{backend} ({read_onnx_info(compare).precision})"
    return {"baseline": "torch (eager)", "eager_as_written": "torch (eager, as written)"}[label]


def _table_size(rt):
    export = getattr(getattr(rt.backend, "info", None), "export", None) or {}
    if "r_table_size" in export:
        return int(export["r_table_size"])
    cached = getattr(rt.backend, "cached", None)
    return getattr(cached, "table_size", None)


def _profile(side, stream, threads, providers, device):
    path = side.path
    state = {k: v for k, v in side.full_state.items() if not k.startswith("__")}
    steps = min(10, stream.decode.shape[1] - 1)
    if steps < 1:
        return None
    provs = providers or (["cuda"] if device.startswith("cuda") else ["cpu"])
    return profile_decode(path, state, stream.decode, threads=threads, steps=steps, providers=provs)
