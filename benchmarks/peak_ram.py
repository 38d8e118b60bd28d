"""Peak memory and time of an export and of the runtime, on the large published shapes (random-weight stand-ins),
each in a fresh process (this file with --child). Runs, method and targets: docs/benchmarks.md ("Memory")."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from txl_deploy.bench.peak_usage import proc_status, rss_bytes


def child_export(checkpoint: str, out: str, verify: bool, vocab: str | None) -> dict:
    import onnxruntime  # noqa: F401  (imported before the base is taken, as export imports it)
    import torch  # noqa: F401

    from txl_deploy.checkpoints import load_model
    from txl_deploy.exporters.onnx.export import export_onnx

    base = rss_bytes()
    start = time.perf_counter()
    loaded = load_model(checkpoint, **({"vocab": vocab} if vocab else {}))
    export_onnx(loaded, out, verify=verify, force=True, consume=True)
    return {"seconds": time.perf_counter() - start, "peak": proc_status("VmHWM")["VmHWM"], "base": base}


PROMPT_PATHS = ("prefill", "generate", "step")  # the calls that read a prompt (--runtime-only measures each)
RESIDENT = ("VmRSS", "VmHWM", "RssFile")  # RssFile: the resident pages that are files' (code, mapped files)


def child_runtime(model: str, prefill: int, decode: int, arena: bool, separate: bool = False,
                  path: str = "prefill") -> dict:
    import numpy as np
    import onnxruntime as ort

    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.backends import onnxruntime as ort_backend

    if arena:  # ONNX Runtime's default, for the decode-speed comparison: keep the CPU arena the backend turns off
        class WithArena(ort.SessionOptions):
            def __setattr__(self, name, value):
                super().__setattr__(name, True if name == "enable_cpu_mem_arena" else value)

        ort.SessionOptions = WithArena
    if arena or separate:  # each session reads its own file and prepacks its MatMuls' weights (ORT's default)
        class Prepacked(ort.SessionOptions):
            def add_session_config_entry(self, key, value):
                if key != "session.disable_prepacking":
                    super().add_session_config_entry(key, value)

        ort.SessionOptions = Prepacked
        ort_backend.SharedWeights = lambda *_: None  # noqa: E731  (no pool: OrtBackend opens each file itself)
    base = proc_status(*RESIDENT)
    rt = TxlRuntime.load(model, threads=os.cpu_count())
    loaded = proc_status(*RESIDENT)
    tokens = np.random.default_rng(0).integers(0, rt.n_token, size=(1, prefill + decode))
    start = time.perf_counter()
    if path == "prefill":
        rt.prefill(tokens[:, :prefill])
    elif path == "generate":  # the prompt, then one sampled token
        list(rt.generate(tokens[0, :prefill], max_new_tokens=1))
    else:  # every position's log-probs, handed to the caller (dropped here: what the caller keeps is theirs)
        rt.step(tokens[:, :prefill])
    prefill_s = time.perf_counter() - start
    prompted = proc_status(*RESIDENT)  # what the runtime keeps once a prompt has been read
    times = []
    for i in range(decode):
        t = time.perf_counter()
        rt.step(tokens[:, prefill + i:prefill + i + 1])
        times.append(time.perf_counter() - t)
    decoded = proc_status(*RESIDENT)
    pool = getattr(rt.backend, "weights", None)
    vocab = rt.vocab
    return {"peak": decoded["VmHWM"], "base": base["VmRSS"], "loaded": loaded["VmRSS"],
            "prompted": prompted["VmRSS"], "decoded": decoded["VmRSS"], "path": path,
            "file_backed": {k: v["RssFile"] - base["RssFile"] for k, v in
                            (("loaded", loaded), ("prompted", prompted), ("decoded", decoded))},
            "pool_bytes": pool.held_bytes if pool is not None else None,
            "vocab_bytes": vocab.symbols.nbytes + vocab.index.nbytes if vocab is not None else 0,
            "prefill_s": prefill_s,
            "sessions": 1 + (rt.backend._head is not None) + len(rt.backend._tails),
            "decode_ms": 1e3 * float(np.median(times)),
            "state_bytes": sum(a.nbytes for k, a in rt.save_state().items() if not k.startswith("__"))}


def child(kind: str, *rest) -> dict:
    if kind == "export":
        return child_export(rest[0], rest[1], rest[2] == "1", rest[3] or None)
    return child_runtime(rest[0], int(rest[1]), int(rest[2]), rest[3] == "1", rest[4:5] == ("1",),
                         *rest[5:6])


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def original_model_pt(ours: Path, out: Path) -> Path:
    """The stand-in written as the original code's `torch.save(model)` (tests/helpers/original_checkpoints.py)."""
    sys.path.insert(0, str(harness.ROOT / "tests"))
    from helpers import original_checkpoints as oc
    from helpers.reference_models import kwargs_of

    from txl_deploy.checkpoints import load_model

    model = load_model(ours).build()
    oc.save_original_model_pt(out, model.state_dict(), kwargs_of(model.cfg))
    return out


def estimates(checkpoint: Path, max_segment: int = 512):
    """(mem_len, export estimates, runtime estimate) of the checkpoint, as `txl-deploy info --memory` gives them."""
    from txl_deploy.checkpoints import load_model
    from txl_deploy.exporters.onnx.ram import export_peaks, loaded_weight_bytes, runtime_peak

    loaded = load_model(checkpoint)
    cfg, w = loaded.config, loaded_weight_bytes(loaded)
    return cfg.mem_len, export_peaks(cfg, w, cfg.mem_len, max_segment), runtime_peak(cfg, w, cfg.mem_len, max_segment)


def measure(args) -> dict:
    from txl_deploy.bench.benchmark import machine_info
    from txl_deploy.bench.random_weights import standin_checkpoint

    ours = standin_checkpoint(args.shape, args.cache_dir)
    mem_len, export_est, runtime_est = estimates(ours)
    raw = {"shape": args.shape, "mem_len": mem_len, "decode_steps": args.decode, "machine": machine_info(),
           "runtime_estimate": runtime_est.total, "export": [], "runtime": []}
    formats = args.formats.split(",")
    with tempfile.TemporaryDirectory(prefix="txl-memory-") as work:
        work = Path(work)
        sources = {"ours": ours}
        if "model.pt" in formats:
            sources["model.pt"] = original_model_pt(ours, work / "model.pt")
            (work / "vocab.json").write_bytes((ours / "vocab.json").read_bytes())
        onnx_path = work / "model.onnx"
        for fmt, src in sources.items():
            if fmt not in formats:
                continue
            for verify in (True, False):
                print(f"export {fmt} verify={verify} ...", flush=True)
                r = harness.in_fresh_process("peak_ram", "export", src, onnx_path, int(verify),
                                             work / "vocab.json" if fmt == "model.pt" else "")
                r.update(format=fmt, verify=verify, checkpoint_bytes=checkpoint_bytes(src),
                         estimate=export_est["verify" if verify else "no_verify"].total)
                raw["export"].append(r)
        for arena in (False, True):
            print(f"runtime arena={arena} ...", flush=True)
            r = harness.in_fresh_process("peak_ram", "runtime", onnx_path, mem_len, args.decode, int(arena))
            r.update(arena=arena, weight_bytes=checkpoint_bytes(onnx_path))
            raw["runtime"].append(r)
    return raw


def measure_runtime(args) -> dict:
    """The runtime's rows only (--runtime-only): the shape exported once, then each way of loading it in a fresh
    process."""
    from txl_deploy.bench.benchmark import machine_info
    from txl_deploy.bench.random_weights import shape_config, standin_checkpoint, standin_onnx
    from txl_deploy.contract.metadata import read_onnx_info
    from txl_deploy.contract.parts import Parts

    mem_len = shape_config(args.shape).mem_len
    # Segments up to 64, as decode_efficiency.py exports the shape (the same cached file; a prefill runs in 64s)
    model = standin_onnx(standin_checkpoint(args.shape, args.cache_dir), args.cache_dir, mem_len, max_segment=64)
    info = read_onnx_info(model)
    parts = Parts.from_export(info.export, info.config, model)
    files = [model, *(parts.files(model) if parts is not None else [])]
    raw = {"shape": args.shape, "mem_len": mem_len, "decode_steps": args.decode, "machine": machine_info(),
           "load_average": os.getloadavg(), "model_bytes": checkpoint_bytes(Path(model)),
           "files_bytes": sum(checkpoint_bytes(Path(f)) for f in files), "files": [Path(f).name for f in files],
           "runtime": []}
    for label, arena, separate in (("txl-deploy: weights held once, no prepacking, no CPU arena", False, False),
                                   ("each session its own weights, prepacked, no CPU arena", False, True),
                                   ("ONNX Runtime's defaults: own weights, prepacked, CPU arena", True, True)):
        print(f"runtime {label} ...", flush=True)
        r = harness.in_fresh_process("peak_ram", "runtime", model, mem_len, args.decode, int(arena), int(separate))
        r.update(label=label, arena=arena, separate=separate)
        raw["runtime"].append(r)
    # what the backend keeps after each call that reads a prompt (prefill is the first row's)
    raw["prompts"] = [raw["runtime"][0]]
    for path in PROMPT_PATHS[1:]:
        print(f"runtime after a prompt through {path} ...", flush=True)
        raw["prompts"].append(harness.in_fresh_process("peak_ram", "runtime", model, mem_len, args.decode, 0, 0, path))
    raw["load_average_end"] = os.getloadavg()
    return raw


def render_runtime(raw: dict) -> str:
    from txl_deploy.exporters.onnx.ram import format_bytes as fb

    m, weights = raw["machine"], raw["model_bytes"]
    ours = raw["runtime"][0]
    held = (ours["loaded"] - ours["base"]) / weights
    prompts = raw.get("prompts", [ours])
    kept = {r.get("path", "prefill"): (r["prompted"] - r["base"]) / weights for r in prompts}  # state included
    worst = max(kept, key=kept.get)
    lines = [
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; shared with other jobs (load average over 1 "
        f"minute {raw['load_average'][0]:.2f} at the start, {raw['load_average_end'][0]:.2f} at the end)",
        f"- shape: {raw['shape']} (random-weight stand-in), mem_len {raw['mem_len']}; the files an ONNX Runtime "
        f"backend loads: {', '.join(raw['files'])} ({fb(raw['files_bytes'])} on disk, the model's own weights "
        f"{fb(weights)}); every row is a fresh process",
        f"- each row: load (`TxlRuntime.load`, all cores), a prompt of {raw['mem_len']} tokens, then "
        f"{raw['decode_steps']} decode steps with a full memory; loaded = resident set after the load over the one "
        "before it (the imports done); peak = the process's high-water mark (VmHWM) over the same base",
        "",
        "## Target",
        "",
        *harness.targets_table([
            ("loaded runtime within 1.1x the model's weight bytes", f"{held:.2f}x", held <= 1.1),
            (f"after a prompt of {raw['mem_len']} tokens ({', '.join(kept)}) within 1.15x, everything the process "
             "keeps (its memory state included)", f"{kept[worst]:.3f}x ({worst})", kept[worst] <= 1.15)]),
    ]
    if "prompts" in raw:
        rows = []
        for r in prompts:
            after, pool, files = r["prompted"] - r["base"], r["pool_bytes"], r["file_backed"]["prompted"]
            parts = (pool, r["state_bytes"], r["vocab_bytes"], files,
                     after - pool - r["state_bytes"] - r["vocab_bytes"] - files)  # the rest
            rows.append([f"`{r['path']}`", f"{after / weights:.3f}x", f"{(r['decoded'] - r['base']) / weights:.3f}x",
                         *(f"{x / weights:.3f}x ({fb(x)})" for x in parts), f"{r['prefill_s']:.1f} s"])
        lines += ["", "## What the runtime keeps after a prompt", "",
                  f"Resident set over the base, as a multiple of the weights ({fb(weights)}), after a prompt of "
                  f"{raw['mem_len']} tokens through each call, then after {raw['decode_steps']} decode steps; the "
                  "parts: docs/benchmarks.md (\"Memory\").", "",
                  *harness.table(["prompt through", "after it", "after decoding", "weights", "state", "vocabulary",
                                  "files' pages", "the rest", "prompt time"], rows)]
    lines += [
        "",
        "## Runtime (ONNX Runtime, fp32, CPU)",
        "",
        *harness.table(["how the sessions are loaded", "sessions", "loaded", "x weights", "peak", "x weights",
                        "decode p50", f"prefill of {raw['mem_len']}"],
                       [[r["label"], r["sessions"], fb(loaded), f"{loaded / weights:.2f}x", fb(peak),
                         f"{peak / weights:.2f}x", f"{r['decode_ms']:.1f} ms", f"{r['prefill_s']:.2f} s"]
                        for r in raw["runtime"]
                        for loaded, peak in [(r["loaded"] - r["base"], r["peak"] - r["base"])]]),
        "",
        "How the pool holds each weight once, and what the peak over the loaded level is: docs/benchmarks.md "
        "(\"Memory\"). Decode and prefill times are single runs: see results_efficiency.md for interleaved ones.",
    ]
    return "\n".join(lines)


def render(raw: dict) -> str:
    from txl_deploy.exporters.onnx.ram import format_bytes as fb

    m = raw["machine"]
    ours_rt, default_rt = raw["runtime"]
    budget = ours_rt["weight_bytes"] + ours_rt["state_bytes"]
    verified = [r for r in raw["export"] if r["verify"]]
    plain = [r for r in raw["export"] if not r["verify"]]
    speed = default_rt["decode_ms"] / ours_rt["decode_ms"]

    worst_v = max(r["peak"] / r["checkpoint_bytes"] for r in verified)
    worst_p = max(r["peak"] / r["checkpoint_bytes"] for r in plain)
    slowest = max(r["seconds"] for r in verified)
    lines = [
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}",
        f"- shape: {raw['shape']} (random-weight stand-in), mem_len {raw['mem_len']}, export segments up to 512; "
        "every row is a fresh process; peak = VmHWM (memory-mapped weight pages included), the process included",
        "",
        "## Targets",
        "",
        *harness.targets_table([
            ("export with verification <= 4x the checkpoint", f"{worst_v:.2f}x", worst_v <= 4),
            ("export with --no-verify <= 2.5x the checkpoint", f"{worst_p:.2f}x", worst_p <= 2.5),
            ("verified export <= 90 s", f"{slowest:.0f} s", slowest <= 90),
            ("runtime <= 2x (weights + state)", f"{ours_rt['peak'] / budget:.2f}x", ours_rt["peak"] <= 2 * budget),
            ("runtime decode within 10% of ONNX Runtime's defaults", f"{speed:.2f}x their speed", speed >= 0.9)]),
        "",
        *(["Why the time target is missed: docs/benchmarks.md (\"Memory\")."] if slowest > 90 else []),
        "",
        "## Export",
        "",
        *harness.table(["job", "checkpoint", "peak", "x checkpoint", "time", "estimate (`info --memory`)"],
                       [[f"{r['format']}, {'verified' if r['verify'] else '--no-verify'}", fb(r["checkpoint_bytes"]),
                         fb(r["peak"]), f"{r['peak'] / r['checkpoint_bytes']:.2f}x", f"{r['seconds']:.0f} s",
                         fb(r["estimate"])] for r in raw["export"]]),
        "",
        "`ours` is the txl-deploy folder (safetensors, memory-mapped), `model.pt` the same weights written as the "
        "original code's `torch.save(model)` (zip format, memory-mapped by `torch.load(mmap=True)`).",
        "",
        "## Runtime (ONNX Runtime, fp32, CPU)",
        "",
        f"Load, prefill of {raw['mem_len']} tokens (the last position's log-probs), then {raw['decode_steps']} decode "
        f"steps with a full memory, all cores. Weights {fb(ours_rt['weight_bytes'])}, state "
        f"{fb(ours_rt['state_bytes'])}.",
        "",
        *harness.table(["session", "peak", "x (weights + state)", "decode p50", "estimate (`info --memory`)"],
                       [[name, fb(r["peak"]), f"{r['peak'] / budget:.2f}x", f"{r['decode_ms']:.1f} ms", estimate]
                        for name, r, estimate in (("txl-deploy (no CPU arena)", ours_rt, fb(raw["runtime_estimate"])),
                                                  ("ONNX Runtime defaults (CPU arena)", default_rt, ""))]),
    ]
    return "\n".join(lines)


def measure_and_render(args, command):
    """Measure (with --report-only, read an earlier run's JSON instead) and render the results file."""
    runtime = args.runtime_only
    if args.report_only:
        raw = json.loads(Path(args.md).with_suffix(".json").read_text())
    else:
        raw = {**(measure_runtime if runtime else measure)(args), "command": command}
    title = ("Resident memory of the ONNX Runtime backend with an adaptive softmax's parts" if runtime
             else "Peak RAM and time of export and runtime on the large shapes")
    body = (render_runtime if runtime else render)(raw)
    return harness.results_markdown(title, body, raw.get("command", command)), raw, 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    md = "results_peak_ram_runtime.md" if "--runtime-only" in argv else "results_peak_ram.md"
    p = harness.parser("peak_ram", __doc__, md=md, threads=None)
    p.add_argument("--shape", default="wt103-large")
    p.add_argument("--formats", default="ours,model.pt", help="comma-separated: ours, model.pt")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--report-only", action="store_true", help="measure nothing: rewrite the .md from the .json")
    p.add_argument("--runtime-only", action="store_true",
                   help="the runtime's rows only, with every session an adaptive-softmax model loads "
                        "(default results file benchmarks/results_peak_ram_runtime.md)")
    return harness.main("peak_ram", p, measure_and_render, argv)


if __name__ == "__main__":
    sys.exit(0 if harness.child_main(child) else main())
