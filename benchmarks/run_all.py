"""Run every configuration of benchmarks/configs.json and write benchmarks/RESULTS.md (+ results/*.json).

    .venv/bin/python benchmarks/run_all.py [--only NAME ...] [--threads N]

Each configuration measures its backend against the PyTorch eager reference in one process, interleaved
(`txl_deploy.bench`); stand-ins (random weights of the published shapes) and their ONNX exports are cached in
benchmarks/.cache. The memory bandwidth for the floor is measured in the same run (numpy copy), and one ONNX
Runtime decode step per configuration is profiled by op type.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CACHE = HERE / ".cache"

TARGETS_DOC = """\
Targets (batch 1 unless said, fp32, decode with a full memory, full next-token distribution):
enwik8 base at mem_len 2100 >= 10x eager per token; its latency at mem_len 2100 <= 2x that at 100;
WikiText-103 base at mem_len 640 >= 3x eager per token and within 1.5x of the floor, batch 8 throughput >= 5x
eager; prefill of 512 tokens at least as fast as eager on every shape."""


PREFILL_NOTE = """\
Prefill into an empty memory: the exported graph's memory is a fixed ring of mem_len slots, and a prompt into
an empty memory would compute scores, positional gathers and value products against every masked slot (about
half of a 512-token prefill at mem_len 2100, ONNX Runtime profile). The incremental graph's slot axis is
therefore dynamic and both cached backends feed such a prompt a 1-slot memory instead, which brings ONNX Runtime
level with eager or better. torch-fast still trails eager here: it runs the cached formulation (positional table
product and gathers over [heads, Q, Q]) op by op without fusion, where eager's rel_shift is a pad and a view;
torch-fast is built for decode, where it is faster than eager."""


def reduced(fp32_path: Path, precision: str) -> Path:
    """The stand-in's export converted to `precision` by txl-deploy's own converter (exporters/precision.py), cached.

    Not verified here: the benchmark itself compares its log-probs with the eager fp32 reference."""
    from txl_deploy.exporters.precision import reduce_onnx

    out = fp32_path.with_name(fp32_path.stem + f"-{precision}.onnx")
    if not out.exists():
        reduce_onnx(fp32_path, out, precision=precision, verify=False, log=lambda m: print(m, file=sys.stderr))
    return out


def run_config(cfg: dict, threads) -> dict | None:
    from txl_deploy.bench import run_benchmark
    from txl_deploy.bench.standin import is_shape_name, standin_checkpoint, standin_onnx

    model, reference = cfg["model"], None
    if not is_shape_name(model):
        model = str(ROOT / model)
        if not Path(model).exists():
            if cfg.get("optional"):
                print(f"[{cfg['name']}] skipped: {cfg['model']} is not there", file=sys.stderr)
                return None
            raise SystemExit(f"{model}: not found")
    if cfg.get("precision"):
        reference = standin_checkpoint(model, CACHE) if is_shape_name(model) else Path(model)
        mem_len = cfg["mem_len"][0]
        model = str(reduced(standin_onnx(reference, CACHE, mem_len), cfg["precision"]))
    print(f"[{cfg['name']}] running", file=sys.stderr)
    report = run_benchmark(
        model, backend=cfg.get("backend"), reference=reference, batches=cfg.get("batch", [1]),
        mem_lens=None if cfg.get("precision") else cfg.get("mem_len"), prompt_len=cfg["prompt_len"],
        gen_len=cfg["gen_len"], repeat=cfg["repeat"], warmup=cfg["warmup"], threads=threads, cache_dir=CACHE,
        profile=cfg.get("backend", "onnxruntime") == "onnxruntime", log=lambda m: print(m, file=sys.stderr))
    report["name"] = cfg["name"]
    return report


def _find(reports, name, mem_len=None, batch=1):
    for rep in reports:
        if rep["name"] == name:
            for res in rep["results"]:
                if (mem_len is None or res["mem_len"] == mem_len) and res["batch"] == batch:
                    return res
    return None


def targets(reports) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for every target whose configuration ran."""
    out = []
    e_long, e_short = _find(reports, "enwik8-base", 2100), _find(reports, "enwik8-base", 100)
    if e_long:
        s = e_long["speedup"]["decode_p50"]
        out.append(("enwik8 base, mem_len 2100: >= 10x eager per token", f"{s:.1f}x", s >= 10))
    if e_long and e_short:
        r = e_long["sides"]["candidate"]["decode_ms"]["p50"] / e_short["sides"]["candidate"]["decode_ms"]["p50"]
        out.append(("enwik8 base: latency at mem_len 2100 <= 2x at 100", f"{r:.2f}x", r <= 2))
    w1, w8 = _find(reports, "wt103-base", 640, 1), _find(reports, "wt103-base", 640, 8)
    if w1:
        s = w1["speedup"]["decode_p50"]
        out.append(("WikiText-103 base, mem_len 640: >= 3x eager per token", f"{s:.1f}x", s >= 3))
        if w1.get("floor"):
            g = w1["floor"]["gap"]
            out.append(("WikiText-103 base: within 1.5x of the floor", f"{g:.2f}x of {w1['floor']['floor_ms']:.1f} ms",
                        g <= 1.5))
    if w8:
        s = w8["speedup"]["decode_tokens_per_s"]
        out.append(("WikiText-103 base, batch 8: throughput >= 5x eager", f"{s:.1f}x", s >= 5))
    for rep in reports:
        for res in rep["results"]:
            if res.get("speedup") and rep["settings"]["prompt_len"] == 512:
                s = res["speedup"]["prefill"]
                out.append((f"{rep['name']} (mem_len {res['mem_len']}, batch {res['batch']}): prefill of 512 "
                            "tokens >= eager", f"{s:.1f}x", s >= 1))
    return out


def results_md(reports, bandwidth_note: str) -> str:
    from txl_deploy.bench.profile import profile_table
    from txl_deploy.bench.report import table

    first = reports[0]
    v, m = first["versions"], first["machine"]
    lines = [
        "# Benchmark results",
        "",
        "Written by `benchmarks/run_all.py` (configurations in `benchmarks/configs.json`); do not edit by hand.",
        "",
        f"- date: {first['date']} (each configuration's own date is in results/NAME.json)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}, GPU: {m['gpu'] or 'none'}",
        f"- versions: python {v['python']}, numpy {v['numpy']}, onnxruntime {v['onnxruntime']}, torch {v['torch']}, "
        f"txl-deploy {v['txl_deploy']}",
        f"- threads: {first['settings']['threads'] or 'library defaults'}; fp32 unless the name says otherwise",
        f"- {bandwidth_note}",
        "",
        "How to read this: every row pair was measured in one process on the same token stream, the backend and the",
        "PyTorch eager reference alternating per repeat (A B, B A, A B), because this machine is shared (2 cores, other",
        "jobs running, e.g. a model being trained): absolute milliseconds move with the load, the ratios between",
        "medians of interleaved measurements are what to compare. Decode = one token with a full memory, the full",
        "next-token distribution; prefill = the prompt into an empty memory. `floor gap` = measured decode p50 /",
        "((weight bytes + memory bytes read per step) / measured copy bandwidth). Stand-ins have random weights.",
        "",
        "## Targets",
        "",
        TARGETS_DOC,
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    met_all = targets(reports)
    for name, value, met in met_all:
        lines.append(f"| {name} | {value} | {'yes' if met else 'NO'} |")
    if any(not met and "prefill" in name for name, _, met in met_all):
        lines += ["", PREFILL_NOTE]
    for rep in reports:
        s = rep["settings"]
        lines += ["", f"## {rep['name']}", "",
                  f"model `{rep['model'] if rep['source'] == 'shape' else Path(rep['model']).name}` "
                  f"({rep['source']}), backend {s['backend']}, prompt {s['prompt_len']}, "
                  f"{s['gen_len']} decode steps x {s['repeat']} repeats, warmup {s['warmup']}", "", "```",
                  table(rep), "```"]
        for res in rep["results"]:
            if res.get("floor"):
                f = res["floor"]
                lines.append(f"- mem_len {res['mem_len']} batch {res['batch']}: floor {f['floor_ms']:.1f} ms = "
                             f"({f['weight_bytes'] / 1e6:.0f} MB weights, of which output layer "
                             f"{f['output_layer_bytes'] / 1e6:.0f} MB, + {f['memory_bytes'] / 1e6:.0f} MB memory) / "
                             f"{f['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; measured {f['gap']:.2f}x the floor")
        for res in rep["results"]:
            if res.get("profile"):
                lines += ["", f"Profile of one decode step (ONNX Runtime profiler, median of steps), mem_len "
                              f"{res['mem_len']} batch {res['batch']}:", "", "```", profile_table(res["profile"], 10),
                          "```"]
    # Results written by the other benchmark scripts, included so RESULTS.md holds every measured figure.
    for name, script in (("results_precision.md", "precision.py"), ("results_triton.md", "triton_load.py")):
        part = HERE / name
        if part.is_file():
            text = part.read_text(encoding="utf-8").strip().splitlines()
            lines += ["", f"<!-- from benchmarks/{name}, written by benchmarks/{script} -->",
                      *("#" + ln if ln.startswith("#") else ln for ln in text)]
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for both sides (default 1: on a shared 2-core machine a second intra-op "
                         "thread mostly waits for a descheduled peer; 0 = each library's default)")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    args = ap.parse_args()
    configs = all_configs = json.loads((HERE / "configs.json").read_text())["configs"]
    if args.only:
        configs = [c for c in configs if c["name"] in args.only]
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    reports = []
    for cfg in all_configs:
        saved = results_dir / f"{cfg['name']}.json"
        if cfg not in configs:  # --only: the other configurations keep their last results
            if saved.exists():
                reports.append(json.loads(saved.read_text()))
            continue
        rep = run_config(cfg, args.threads or None)
        if rep is None:
            continue
        saved.write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
        reports.append(rep)
    if not reports:
        raise SystemExit("nothing ran")
    bws = [r["floor"]["bandwidth_bytes_per_s"] / 1e9 for rep in reports for r in rep["results"] if r.get("floor")]
    note = (f"memory bandwidth (numpy copy, read + write, best of 7, one thread), measured at the start of each "
            f"configuration: {min(bws):.1f} to {max(bws):.1f} GB/s (it moves with the other jobs' load; each floor "
            "uses its own configuration's value)" if bws else "memory bandwidth: not measured")
    Path(args.out).write_text(results_md(reports, note))
    try:  # latency against memory length and batch size, where matplotlib is installed
        from txl_deploy.bench.report import plot

        for rep in reports:
            if len(rep["results"]) > 1:
                plot(rep, results_dir / f"{rep['name']}.png", force=True)
    except Exception as e:  # the plot is a convenience; the table and JSON are the results
        print(f"no plots ({e})", file=sys.stderr)
    for name, value, met in targets(reports):
        print(f"{'ok ' if met else 'MISS'} {name}: {value}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
