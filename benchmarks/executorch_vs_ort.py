"""ExecuTorch programs (.pte, XNNPACK; fp32 and int4 8da4w) beside ONNX Runtime graphs (fp32 and int4) in one run:
decode and prefill latency, file size, peak RAM of a fresh process, where an ExecuTorch step goes, and parity.
Method: docs/benchmarks.md ("ExecuTorch beside ONNX Runtime")."""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.harness import CACHE
from benchmarks.int4 import int4_graph
from txl_deploy.assets import DEMO_DIR
from txl_deploy.bench.benchmark import machine_info, versions, versions_text
from txl_deploy.bench.peak_usage import proc_status, rss_bytes
from txl_deploy.bench.random_weights import standin_checkpoint, standin_onnx
from txl_deploy.contract.pte_file import read_pte_info
from txl_deploy.errors import InputError
from txl_deploy.exporters.onnx.ram import format_bytes as fb
from txl_deploy.exporters.onnx.ram import state_bytes as ram_state_bytes
from txl_deploy.exporters.precision.int4 import INT4_DEFAULT_BLOCK
from txl_deploy.runtimes import TxlRuntime

MAX_SEGMENT = 128  # the programs' and graphs' longest segment: the prefill size must fit in one call
RSS_DECODE_STEPS = 8
PROFILE_STEPS = 20

FILES = ("ExecuTorch fp32", "ExecuTorch int4 (8da4w)", "ONNX Runtime fp32", "ONNX Runtime int4")
PARITY = {"ExecuTorch fp32": "ONNX Runtime fp32", "ExecuTorch int4 (8da4w)": "ONNX Runtime fp32"}


def pte_export(checkpoint: Path, name: str, precision: str, mem_len: int, eval_text=None) -> Path:
    """The .pte of `checkpoint` at `precision`, exported (and verified) once per exporter version."""
    from txl_deploy.exporters.executorch import export as pte
    from txl_deploy.model import linear_step

    out = CACHE / f"{name}-m{mem_len}-s{MAX_SEGMENT}-{precision}-{harness.code_key(pte, linear_step)}.pte"
    if not out.exists():
        t0 = time.perf_counter()
        pte.export_executorch(checkpoint, out, precision=precision, mem_len=mem_len, max_segment=MAX_SEGMENT,
                              eval_text=eval_text, verify=eval_text is not None or precision == "fp32",
                              force=True)
        print(f"ExecuTorch {precision} export of {name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out


def shape_files(shape: str, mem_len: int) -> tuple[dict, int]:
    """{file label: path} of one shape, and the mem_len its files were exported with."""
    if shape == "demo":
        checkpoint, eval_text = DEMO_DIR / "kjv-char", DEMO_DIR / "heldout.txt"
        mem_len = json.loads((checkpoint / "config.json").read_text())["config"]["mem_len"]
    else:
        checkpoint, eval_text = standin_checkpoint(shape, CACHE), None
    name = "kjv-char" if shape == "demo" else shape
    fp32 = standin_onnx(checkpoint, CACHE, mem_len, max_segment=MAX_SEGMENT)
    int4 = int4_graph(fp32, INT4_DEFAULT_BLOCK, eval_data=eval_text, verify=eval_text is not None)[0]
    return {"ExecuTorch fp32": pte_export(checkpoint, name, "fp32", mem_len),
            "ExecuTorch int4 (8da4w)": pte_export(checkpoint, name, "int4", mem_len, eval_text),
            "ONNX Runtime fp32": fp32, "ONNX Runtime int4": int4}, mem_len


def timing(paths: dict, threads: int, steps: int, prefill: int, repeat: int, seed: int = 0) -> dict:
    """Decode and prefill times of every file in one process, interleaved; log-probs of the timed decode steps."""
    runtimes = {label: TxlRuntime.load(path, threads=threads) for label, path in paths.items()}
    rng = np.random.default_rng(seed)
    tokens, full = harness.fill_memories(runtimes, steps, rng)
    prompt = rng.integers(0, next(iter(runtimes.values())).n_token, size=(1, prefill))
    decode = {label: [] for label in runtimes}
    log_probs = {label: [] for label in runtimes}

    def step(label, k):
        t0 = time.perf_counter()
        log_probs[label].append(runtimes[label].step([[int(tokens[k])]])[0, -1])
        decode[label].append(time.perf_counter() - t0)

    def prefill_time(label, r):
        runtimes[label].load_state(full[label])
        return harness.seconds(lambda: runtimes[label].prefill(prompt))

    harness.interleaved({label: functools.partial(step, label) for label in runtimes}, steps)
    prefill_s = harness.interleaved({label: functools.partial(prefill_time, label) for label in runtimes}, repeat + 1)
    prefill_s = {label: s[1:] for label, s in prefill_s.items()}  # the first round warms prefill-sized buffers
    for rt in runtimes.values():
        rt.close()
    lps = {label: np.stack(v) for label, v in log_probs.items()}
    parity = {}
    for et, ort_label in PARITY.items():
        if et in lps and ort_label in lps:
            a, b = lps[et], lps[ort_label]
            parity[et] = {"against": ort_label, "max_abs_diff": float(np.max(np.abs(a - b))),
                          "top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
                          "kl": float(np.mean(np.sum(np.exp(b) * (b - a), axis=-1)))}
    return {"decode_ms": {k: 1e3 * float(np.median(v)) for k, v in decode.items()},
            "decode_p90_ms": {k: 1e3 * float(np.percentile(v, 90)) for k, v in decode.items()},
            "prefill_ms": {k: 1e3 * float(np.median(v)) for k, v in prefill_s.items()},
            "parity": parity, "steps": steps, "prefill": prefill, "repeat": repeat}


# -- peak RAM, in a fresh process per file ---------------------------------------------------------------------

def child_memory(path: str, threads) -> dict:
    """Load `path`, fill its memory, decode a few tokens: the process's peak, and its resident set before loading."""
    if path.endswith(".pte"):  # the imports a .pte app pays for, before the base is taken
        import torch  # noqa: F401
        from executorch.runtime import Runtime  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    base = rss_bytes()
    rt = TxlRuntime.load(path, threads=int(threads))
    loaded = rss_bytes()
    rng = np.random.default_rng(0)
    rt.prefill(rng.integers(0, rt.n_token, size=(1, rt.mem_len)))
    for tok in rng.integers(0, rt.n_token, size=RSS_DECODE_STEPS):
        rt.step([[int(tok)]])
    status = proc_status("VmRSS", "VmHWM")
    return {"peak": status["VmHWM"], "base": base, "loaded": loaded, "rss": status["VmRSS"]}


# -- where an ExecuTorch step goes -----------------------------------------------------------------------------

def profile_pte(path: Path, threads: int, steps: int = PROFILE_STEPS, seed: int = 0) -> dict:
    """ETDump of `steps` decode steps (batch 1, memory full): median ms per step of the XNNPACK delegate calls, of
    each portable operator (its kernel plus the runtime's dispatch of it) and of the whole execute."""
    from executorch.devtools import Inspector  # optional (the executorch extra): ETDump's reader
    from executorch.runtime import Runtime  # optional (the executorch extra)

    from txl_deploy.runtimes.backends.executorch import ExecuTorchBackend  # imports torch and executorch

    backend = ExecuTorchBackend(path, threads)  # as TxlRuntime.load opens it, the program reloaded with ETDump on
    program = backend._program = Runtime.get().load_program(str(path), enable_etdump=True, debug_buffer_size=0)
    backend.method = program.load_method("forward")
    info, rng = backend.info, np.random.default_rng(seed)
    with TxlRuntime(backend) as rt:
        rt.prefill(rng.integers(0, rt.n_token, size=(1, rt.mem_len)))
        for tok in rng.integers(0, rt.n_token, size=steps):
            rt.step([[int(tok)]])
    with tempfile.TemporaryDirectory(prefix="txl-etdump-") as work:
        etdump = Path(work) / "step.etdp"
        program.write_etdump_result_to_file(str(etdump), str(Path(work) / "debug.bin"))
        frame = Inspector(etdump_path=str(etdump)).to_dataframe()
    names = frame["event_name"].astype(str)
    runs = len(frame[names == "Method::execute"]["raw"].iloc[0])
    frame = frame[[len(r) == runs for r in frame["raw"]]]  # the events of every execute (not the program's load)
    names = frame["event_name"].astype(str)
    last = slice(runs - steps, runs)  # the decode steps only (the memory fill came first)

    def per_step(rows) -> float:
        """Median over the decode steps of the summed time (ms) of `rows` in one step."""
        if len(rows) == 0:
            return 0.0
        return float(np.median(np.sum([np.asarray(r[last], dtype=float) for r in rows["raw"]], axis=0)))

    top = ~frame["is_delegated_op"].astype(bool)
    total = per_step(frame[names == "Method::execute"])
    delegate = per_step(frame[top & (names == "DELEGATE_CALL")])
    dispatch = per_step(frame[top & (names == "OPERATOR_CALL")])
    portable = {}
    for name in sorted(set(names[top & names.str.startswith("native_call_")])):
        op = name[len("native_call_"):].rsplit(".", 1)[0]
        portable[op] = portable.get(op, 0.0) + per_step(frame[top & (names == name)])
    xnn = {}
    for name in sorted(set(names[frame["is_delegated_op"].astype(bool)])):
        op = name.split(" #")[0]
        xnn[op] = xnn.get(op, 0.0) + per_step(frame[names == name])
    return {"execute_ms": total, "xnnpack_ms": delegate, "portable_ms": dispatch,
            "portable_kernels_ms": sum(portable.values()), "portable_by_op_ms": portable, "xnnpack_by_op_ms": xnn,
            "xnnpack_calls": int(((names == "DELEGATE_CALL") & top).sum()),
            "portable_calls": int(((names == "OPERATOR_CALL") & top).sum()),
            "partitions": info.export.get("xnnpack_partitions"), "portable_ops": info.export.get("portable_ops", []),
            "steps": steps}


# -- the report ------------------------------------------------------------------------------------------------

def _op(name: str) -> str:
    """aten.gather.default (or its EdgeOpOverload repr) -> gather."""
    name = name.split(":")[0].replace("<EdgeOpOverload", "").strip(" <>")
    return name.removeprefix("aten.").rsplit(".", 1)[0]


def _slowest(head: str, ms_by_op: dict, top: int) -> list[str]:
    return harness.table([head, "ms / step"], [[op, f"{ms:.3f}"] for op, ms in
                                               sorted(ms_by_op.items(), key=lambda kv: -kv[1])[:top]])


def render(raw: dict) -> str:
    m, v = raw["machine"], raw["versions"]
    lines = [
        f"- machine: {m['cpu']}, {m['cores']} cores (shared with other jobs; load average {raw['load']}), "
        f"{m['platform']}",
        f"- versions: {versions_text({**v, **raw}, ('python', 'onnxruntime', 'executorch', 'torch', 'txl_deploy'))}",
        f"- every runtime on {raw['threads']} intra-op thread(s), batch 1, in one process, taking turns token by "
        "token, each through `TxlRuntime.load`; method: docs/benchmarks.md (\"ExecuTorch beside ONNX Runtime\")",
        f"- decode: the memory full, median of {raw['steps']} steps per file; prefill: {raw['prefill']} tokens into "
        f"the full memory, median of {raw['repeat']} rounds; peak RAM: a fresh process per file (load, fill the "
        f"memory, decode {RSS_DECODE_STEPS} tokens), VmHWM, what it added after the imports, and of that by the load",
        "",
    ]
    ratio_lines = []
    for shape in raw["shapes"]:
        t, files, mem = shape["timing"], shape["files"], shape["memory"]
        ref = t["decode_ms"]["ONNX Runtime fp32"]
        lines += [f"## {shape['title']}", "",
                  f"mem_len {shape['mem_len']}; the memory of one stream is {fb(shape['state_bytes'])} (fp32 keys "
                  "and values of every layer).", "",
                  *harness.table(["file", "decode ms / token (p50)", "p90", "x ONNX Runtime fp32",
                                  f"prefill {raw['prefill']} ms", "file MB", "peak RAM", "added after imports",
                                  "of which by the load"],
                                 [[label, f"{t['decode_ms'][label]:.2f}", f"{t['decode_p90_ms'][label]:.2f}",
                                   f"{t['decode_ms'][label] / ref:.2f}x", f"{t['prefill_ms'][label]:.1f}",
                                   f"{files[label]['mb']:.2f}", fb(mem[label]["peak"]),
                                   fb(mem[label]["peak"] - mem[label]["base"]),
                                   fb(mem[label]["loaded"] - mem[label]["base"])] for label in files])]
        et, et4 = t["decode_ms"]["ExecuTorch fp32"], t["decode_ms"]["ExecuTorch int4 (8da4w)"]
        ort4 = t["decode_ms"]["ONNX Runtime int4"]
        ratio_lines.append(f"{shape['title']}: ExecuTorch fp32 decode {et / ref:.2f}x ONNX Runtime fp32's time, "
                           f"ExecuTorch int4 {et4 / ort4:.2f}x ONNX Runtime int4's, ExecuTorch int4 {et / et4:.2f}x "
                           f"faster than its fp32; prefill ExecuTorch fp32 "
                           f"{t['prefill_ms']['ExecuTorch fp32'] / t['prefill_ms']['ONNX Runtime fp32']:.2f}x "
                           "ONNX Runtime fp32's time")
        lines += ["", "Parity on the timed decode steps (each ExecuTorch program against ONNX Runtime fp32, both "
                  "fed the same stream):", ""]
        for label, p in t["parity"].items():
            lines.append(f"- {label}: max abs difference of the log-probs {p['max_abs_diff']:.2g}, top-1 agreement "
                         f"{p['top1_agreement']:.3f}, KL {p['kl']:.2g} nats per position")
        acc = shape.get("int4_accuracy")
        if acc:
            lines.append(f"- ExecuTorch int4 on the demo model's held-out text (the export's gate): "
                         f"{acc['metric'].replace('_', ' ')} {acc['reduced']:.4f} against fp32 {acc['fp32']:.4f} "
                         f"({100 * acc['relative_change']:+.2f}%, limit +2%)")
        for label in ("ExecuTorch fp32", "ExecuTorch int4 (8da4w)"):
            prof = shape["profiles"].get(label)
            if not prof:
                continue
            share = prof["portable_ms"] / prof["execute_ms"]
            lines += ["", f"Where a {label} decode step goes (ETDump, median of {prof['steps']} steps; the tracer "
                      f"adds its own cost): execute {prof['execute_ms']:.2f} ms, of which {prof['xnnpack_calls']} "
                      f"XNNPACK delegate calls {prof['xnnpack_ms']:.2f} ms "
                      f"({100 * prof['xnnpack_ms'] / prof['execute_ms']:.0f}%) and {prof['portable_calls']} "
                      f"portable-kernel calls {prof['portable_ms']:.2f} ms ({100 * share:.0f}%; their kernels "
                      f"{prof['portable_kernels_ms']:.2f} ms, the rest the runtime's dispatch).", "",
                      *_slowest("portable operator", prof["portable_by_op_ms"], 8),
                      "", *_slowest("XNNPACK operator", prof["xnnpack_by_op_ms"], 6)]
        lines.append("")
    first = raw["shapes"][0]["profiles"].get("ExecuTorch fp32") or {}
    lines += ["## Which operators XNNPACK takes", "",
              (f"XNNPACK takes the matrix products (Fully Connected, Batch Matrix Multiply), the adds, "
              f"multiplications, transposes, copies and the softmax's exponentials, in "
              f"{first.get('partitions', '?')} partitions on the demo model. Left to ExecuTorch's portable "
              f"kernels: {', '.join(sorted({_op(n) for n in first.get('portable_ops', [])}))}."), "",
              "## Ratios measured in this run", "", *[f"- {r}" for r in ratio_lines], ""]
    return "\n".join(lines)


def measure_files(args) -> dict:
    import executorch
    import torch

    raw = {"machine": machine_info(), "versions": versions(), "threads": args.threads, "steps": args.steps,
           "prefill": args.prefill, "repeat": args.repeat, "torch": torch.__version__,
           "executorch": getattr(executorch, "__version__", None) or harness.package_version("executorch"), "shapes": []}
    for shape in args.shapes.split(","):
        files, mem_len = shape_files(shape, args.mem_len)
        print(f"{shape}: timing ...", file=sys.stderr, flush=True)
        t = timing(files, args.threads, args.steps, args.prefill, args.repeat)
        print(f"{shape}: peak RAM and profiles ...", file=sys.stderr, flush=True)
        mem = {label: harness.in_fresh_process("executorch_vs_ort", path, args.threads) for label, path in files.items()}
        profiles = {label: profile_pte(files[label], args.threads) for label in FILES[:2]}
        info = read_pte_info(files["ExecuTorch fp32"], check_hash=False)
        int4_info = read_pte_info(files["ExecuTorch int4 (8da4w)"], check_hash=False)
        report = int4_info.export.get("precision_report") or {}
        raw["shapes"].append({
            "name": shape, "mem_len": mem_len,
            "title": ("demo model `kjv-char`" if shape == "demo" else f"{shape} shape, random weights"),
            "state_bytes": int(ram_state_bytes(info.config, mem_len)), "timing": t, "memory": mem, "profiles": profiles,
            "int4_accuracy": report.get("accuracy"),
            "files": {label: {"path": path.name, "mb": path.stat().st_size / 1e6} for label, path in files.items()}})
    raw["load"] = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return raw


def measure(args, command):
    if not 1 <= args.prefill <= MAX_SEGMENT:
        raise InputError(f"--prefill must be 1 to {MAX_SEGMENT}")
    if args.report_only:
        raw = json.loads(Path(args.md).with_suffix(".json").read_text())
    else:
        CACHE.mkdir(exist_ok=True)
        raw = {**measure_files(args), "command": command}
    text = harness.results_markdown("ExecuTorch (XNNPACK) beside ONNX Runtime, one thread each", render(raw),
                                    raw["command"])
    return text, raw, 0


def main(argv=None) -> int:
    p = harness.parser("executorch_vs_ort", __doc__, md="results_executorch.md", cache=False)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per file (default 64)")
    p.add_argument("--prefill", type=int, default=64, help=f"prefill tokens, at most {MAX_SEGMENT} (default 64)")
    p.add_argument("--repeat", type=int, default=5, help="prefill rounds per file (default 5)")
    p.add_argument("--mem-len", type=int, default=512, help="the enwik8-base stand-in's mem_len (default 512)")
    p.add_argument("--shapes", default="demo,enwik8-base", help="comma-separated: demo and published shape names")
    p.add_argument("--report-only", action="store_true", help="measure nothing: rewrite the .md from the .json")
    return harness.main("executorch_vs_ort", p, measure, argv)


if __name__ == "__main__":
    sys.exit(0 if harness.child_main(child_memory) else main())
