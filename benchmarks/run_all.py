"""Every configuration of benchmarks/configs.json through `txl-deploy bench`'s `run_benchmark`, then
benchmarks/RESULTS.md written whole: its own tables, then every results_*.md that names the command that wrote it.
--scripts runs the other benchmarks first (`SCRIPTS`). How to read it: docs/benchmarks.md."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import CACHE, HERE, ROOT, command, generating_command
from txl_deploy.bench import run_benchmark
from txl_deploy.bench.benchmark import versions_text
from txl_deploy.bench.op_profile import profile_table
from txl_deploy.bench.random_weights import is_shape_name, standin_checkpoint, standin_onnx
from txl_deploy.bench.report import plot, table
from txl_deploy.exporters.precision.convert import reduce_onnx

TARGETS_DOC = """\
Targets (batch 1 unless said, fp32, decode with a full memory, full next-token distribution):
enwik8 base at mem_len 2100 >= 10x eager per token; its latency at mem_len 2100 <= 2x that at 100;
WikiText-103 base at mem_len 640 >= 3x eager per token and within 1.3x of the floor, batch 8 throughput >= 5x
eager; int8-dynamic >= 1.8x fp32 ONNX Runtime per token on the WikiText-103 base shape; prefill of 512 tokens at
least 1x eager on every shape, where eager applies its output layer only at the last prompt position (what a
text generator needs), not at all 512."""


PREFILL_NOTE = "Why a prefill target is missed: docs/benchmarks.md (\"Reading the results\")."


# The other benchmark scripts, each with the command that writes its results file (the command every results
# file names), in the order --scripts all runs them.
SCRIPTS = {
    "table9": ["paper_table9", "--force"],
    "peers": ["peers", "--force"],
    "int4": ["int4", "--force"],
    "efficiency": ["decode_efficiency", "--force"],
    "lazy-decode": ["lazy_decode", "--force"],
    "scoring": ["scoring", "--force"],
    "precision": ["precision", "--out", "/tmp/bench/prec", "--force"],
    "triton": ["triton_load", "--force"],
    "serve": ["serve_load", "--model", "txl_deploy/assets/demo/kjv-char", "--model", "enwik8-base", "--force"],
    "chaos": ["serve_chaos", "--force"],
    "peak-ram": ["peak_ram", "--force"],
    "peak-ram-runtime": ["peak_ram", "--runtime-only", "--shape", "wt103-base", "--force"],
    "executorch": ["executorch_vs_ort", "--force"],
    "mobile": ["mobile_usability", "--force"],
}


def run_scripts(names: list[str]):
    """Each named script in a fresh process, from the repository root (so every results file names the same
    command as when run by hand); stops at the first that fails."""
    for name in names:
        module, *args = SCRIPTS[name]
        print(f"[{name}] {command(module, args)}", file=sys.stderr)
        if subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], cwd=ROOT, check=False).returncode:
            raise SystemExit(f"[{name}] failed: {command(module, args)}")


def reduced(fp32_path: Path, precision: str) -> Path:
    """The export converted to `precision` (cached; unverified: the benchmark compares it with eager fp32)."""
    out = fp32_path.with_name(fp32_path.stem + f"-{precision}.onnx")
    if not out.exists():
        reduce_onnx(fp32_path, out, precision=precision, verify=False)
    return out


def run_config(cfg: dict, threads) -> dict | None:
    model, reference, compare = cfg["model"], None, None
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
        fp32 = standin_onnx(reference, CACHE, mem_len)
        model = str(reduced(fp32, cfg["precision"]))
        compare = fp32 if cfg.get("compare_fp32") else None
    print(f"[{cfg['name']}] running", file=sys.stderr)
    report = run_benchmark(
        model, backend=cfg.get("backend"), reference=reference, batches=cfg.get("batch", [1]),
        mem_lens=None if cfg.get("precision") else cfg.get("mem_len"), prompt_len=cfg["prompt_len"],
        gen_len=cfg["gen_len"], repeat=cfg["repeat"], warmup=cfg["warmup"], threads=threads, cache_dir=CACHE,
        profile=cfg.get("backend", "onnxruntime") == "onnxruntime", as_written_batches=cfg.get("eager_as_written", ()),
        compare=compare)
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
            f, name = w1["floor"], "WikiText-103 base: within 1.3x of the floor"
            said = f"{f['gap']:.2f}x of {f['floor_ms']:.1f} ms"
            if not f.get("gap_rounds"):  # results of a run that took the bandwidth at another moment
                out.append((name, f"{said}, the copy bandwidth measured before the decode steps, not in their "
                            "rounds: not comparable (run the configuration again)", None))
            else:
                said += f" (rounds {min(f['gap_rounds']):.2f}-{max(f['gap_rounds']):.2f}x){read_clause(f)}"
                out.append((name, said + ": below the floor, so the copy bandwidth understates what a decode step "
                            "reads; not a valid floor", None) if f["gap"] < 1 else (name, said, f["gap"] <= 1.3))
    if w8:
        s = w8["speedup"]["decode_tokens_per_s"]
        out.append(("WikiText-103 base, batch 8: throughput >= 5x eager", f"{s:.1f}x", s >= 5))
    q = _find(reports, "wt103-base-int8-dynamic", 640)
    if q and q.get("speedup_vs_compare"):
        s = q["speedup_vs_compare"]["decode_p50"]
        out.append(("WikiText-103 base, int8-dynamic: >= 1.8x fp32 ONNX Runtime per token", f"{s:.2f}x", s >= 1.8))
    for rep in reports:
        for res in rep["results"]:
            if res.get("speedup") and rep["settings"]["prompt_len"] == 512:
                s = res["speedup"]["prefill"]
                out.append((f"{rep['name']} (mem_len {res['mem_len']}, batch {res['batch']}): prefill of 512 "
                            "tokens >= 1x eager", f"{s:.2f}x", s >= 1))
    return out


def read_clause(f: dict) -> str:
    """What one thread's pure read of a step's bytes takes in the same rounds, beside the floor; "" if not measured."""
    if not f.get("read_ms"):
        return ""
    return (f"; a pure read of the same bytes at the read bandwidth of the same rounds "
            f"({f['read_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s) takes {f['read_ms']:.1f} ms, "
            f"{f['read_over_floor']:.2f}x the floor; the step is {f['read_gap']:.2f}x that read")


def included_results() -> tuple[list[tuple[Path, str, str]], list[Path]]:
    """Every benchmarks/results_*.md: (path, generating command, text) for those that name their command, and the
    paths of those that do not (left out of RESULTS.md)."""
    ok, left_out = [], []
    for path in sorted(HERE.glob("results_*.md")):
        text = path.read_text(encoding="utf-8")
        command = generating_command(text)
        if command is None:
            left_out.append(path)
        else:
            ok.append((path, command, text))
    return ok, left_out


def results_md(reports, bandwidth_note: str, command: str) -> str:
    first = reports[0]
    v, m = first["versions"], first["machine"]
    threads = {rep["settings"]["threads"] for rep in reports}
    lines = [
        "# Benchmark results",
        "",
        f"Written by `{command}` (configurations in `benchmarks/configs.json`, each configuration's raw numbers in "
        "`benchmarks/results/NAME.json`); do not edit by hand. The sections after the configurations are the "
        "`benchmarks/results_*.md` files of the other benchmark scripts, each naming the command that wrote it.",
        "",
        f"- date: {min(rep['date'] for rep in reports)} to {max(rep['date'] for rep in reports)} (each "
        "configuration's own date is in its JSON)",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['platform']}, GPU: {m['gpu'] or 'none'}",
        f"- versions: {versions_text(v, ('python', 'numpy', 'onnxruntime', 'torch', 'txl_deploy'))}",
        "- threads: " + ", ".join(f"{t} per side (ONNX Runtime intra-op threads, torch.set_num_threads)" if t
                                  else "library defaults" for t in sorted(threads, key=str))
        + ", every row; fp32 unless the name says otherwise",
        f"- {bandwidth_note}",
        "",
        "How to read this (every row of a group measured in one process, the sides interleaved; the floor; peak "
        "memory): docs/benchmarks.md, \"Reading the results\". Stand-ins have random weights.",
        "",
        "## Targets",
        "",
        TARGETS_DOC,
        "",
    ]
    met_all = targets(reports)
    lines += harness.targets_table(met_all)
    if any(met is False and "prefill" in name for name, _, met in met_all):
        lines += ["", PREFILL_NOTE]
    for rep in reports:
        s = rep["settings"]
        lines += ["", f"## {rep['name']}", "",
                  f"model `{rep['model'] if rep['source'] == 'shape' else Path(rep['model']).name}` "
                  f"({rep['source']}), backend {s['backend']}, prompt {s['prompt_len']}, "
                  f"{s['gen_len']} decode steps x {s['repeat']} repeats, warmup {s['warmup']}, threads "
                  f"{s['threads'] or 'library defaults'}, measured {rep['date']}", "", "```", table(rep), "```"]
        for res in rep["results"]:
            if res.get("floor"):
                f = res["floor"]
                rounds = ""
                if f.get("gap_rounds"):
                    rounds = (f" (copy bandwidth {min(f['bandwidth_rounds']) / 1e9:.1f} to "
                              f"{max(f['bandwidth_rounds']) / 1e9:.1f} GB/s over the rounds; each round's decode "
                              f"median over its own floor: {min(f['gap_rounds']):.2f}x to "
                              f"{max(f['gap_rounds']):.2f}x)")
                rounds += read_clause(f)
                lines.append(f"- mem_len {res['mem_len']} batch {res['batch']}: floor {f['floor_ms']:.1f} ms = "
                             f"({f['weight_bytes'] / 1e6:.0f} MB weights, of which output layer "
                             f"{f['output_layer_bytes'] / 1e6:.0f} MB, + {f['memory_bytes'] / 1e6:.0f} MB memory) / "
                             f"{f['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s; measured {f['gap']:.2f}x the floor{rounds}")
        aw = set(s.get("as_written_batches") or ())
        if aw and any(res["batch"] not in aw for res in rep["results"]):
            big = rep.get("config") or {}
            per_row = f" ({s['prompt_len'] * big['n_token'] * 4 / 1e6:.0f} MB per row in float32)" \
                if big.get("n_token") else ""
            lines.append(f"- eager as written is timed at batch {', '.join(map(str, sorted(aw)))} only: at larger "
                         f"batches its prefill holds batch x {s['prompt_len']} x {big.get('n_token', 'V')} "
                         f"log-probabilities at once{per_row}, more memory than this shared machine can spare")
        for res in rep["results"]:
            if res.get("profile"):
                lines += ["", f"Profile of one decode step (ONNX Runtime profiler, median of steps), mem_len "
                              f"{res['mem_len']} batch {res['batch']}:", "", "```", profile_table(res["profile"], 10),
                          "```"]
    # Results written by the other benchmark scripts, so RESULTS.md holds every measured figure; one heading level
    # down so that they nest under this document's title.
    included, left_out = included_results()
    for path, cmd, text in included:
        lines += ["", f"<!-- benchmarks/{path.name}, written by: {cmd} -->",
                  *("#" + ln if ln.startswith("#") else ln for ln in text.strip().splitlines())]
    if left_out:
        lines += ["", "## Left out", "",
                  *(f"- `benchmarks/{p.name}`: it does not say which command generated it" for p in left_out)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="configuration names to run (default: all); the others keep their "
                                              "last results (results/NAME.json)")
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads for both sides (default 1: on a shared 2-core machine a second intra-op "
                         "thread mostly waits for a descheduled peer; 0 = each library's default)")
    ap.add_argument("--report-only", action="store_true",
                    help="measure nothing: write RESULTS.md from results/*.json and the results_*.md files")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--scripts", default="",
                    help=f"other benchmark scripts to run first, comma-separated: {', '.join(SCRIPTS)}, or all "
                         "(default none: their last results files are taken in as they are)")
    args = ap.parse_args(argv)
    all_configs = json.loads((HERE / "configs.json").read_text())["configs"]
    scripts = list(SCRIPTS) if args.scripts == "all" else [s for s in args.scripts.split(",") if s]
    for option, asked, known in (("--scripts", scripts, SCRIPTS), ("--only", args.only or [],
                                                                    [c["name"] for c in all_configs])):
        if set(asked) - set(known):
            raise SystemExit(f"{option} {','.join(sorted(set(asked) - set(known)))}: unknown (known: "
                             f"{', '.join(known)})")
    run_scripts(scripts)
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    reports = []
    for cfg in all_configs:
        saved = results_dir / f"{cfg['name']}.json"
        if args.report_only or (args.only and cfg["name"] not in args.only):  # keeps its last results
            reports += [json.loads(saved.read_text())] if saved.exists() else []
        elif (rep := run_config(cfg, args.threads or None)) is not None:
            saved.write_text(json.dumps(rep, indent=2, sort_keys=True) + "\n")
            reports.append(rep)
    if not reports:
        raise SystemExit("nothing ran")
    # The command that reproduces the whole file (a configuration re-run alone with --only lands in the same place)
    cmd = command("run_all", [] if args.threads == 1 else ["--threads", str(args.threads)])
    Path(args.out).write_text(results_md(reports, bandwidth_note(reports), cmd))
    try:  # latency against memory length and batch size, where matplotlib is installed
        for rep in reports:
            if len(rep["results"]) > 1:
                plot(rep, results_dir / f"{rep['name']}.png", force=True)
    except Exception as e:  # the plot is a convenience; the table and JSON are the results
        print(f"no plots ({e})", file=sys.stderr)
    for name, value, met in targets(reports):
        print(f"{'n/a ' if met is None else 'ok  ' if met else 'MISS'} {name}: {value}")
    for path in included_results()[1]:
        print(f"left out {path.name}: it does not say which command generated it", file=sys.stderr)
    print(f"wrote {args.out}")


def bandwidth_note(reports) -> str:
    """RESULTS.md's line on the copy bandwidth behind the floors: its range, and when it was measured."""
    floors = [r["floor"] for rep in reports for r in rep["results"] if r.get("floor")]
    bws = [bw / 1e9 for f in floors for bw in f.get("bandwidth_rounds", [f["bandwidth_bytes_per_s"]])]
    if not bws:
        return "memory bandwidth: not measured"
    in_rounds = sum(bool(f.get("bandwidth_rounds")) for f in floors)
    when = ("measured in every round of the decode steps it is compared with" if in_rounds == len(floors) else
            "measured once at the start of each configuration" if not in_rounds else
            f"measured in the rounds of the decode steps for {in_rounds} of {len(floors)} floors, at the start of "
            "their configuration for the others")
    return (f"memory bandwidth (numpy copy of 256 MB, read + write, one thread), {when}: {min(bws):.1f} to "
            f"{max(bws):.1f} GB/s (it moves with the other jobs' load; each floor uses its own configuration's)")


if __name__ == "__main__":
    main()
