"""int4 weight-only graphs (MatMulNBits) against fp32: accuracy on the demo model; file size, decode speed, what a
step reads and generation on the WikiText-103 base shape; prepacked and not; other block sizes beside the default.
Method: docs/benchmarks.md ("int4")."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.step_bytes import graph_step_bytes
from txl_deploy.assets import DEMO_DIR
from txl_deploy.bench.op_profile import profile_decode, profile_table
from txl_deploy.bench.peak_usage import rss_bytes
from txl_deploy.bench.random_weights import standin_checkpoint, standin_onnx
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.exporters.precision import convert as precision
from txl_deploy.exporters.precision import folding, int4
from txl_deploy.exporters.precision.int4 import INT4_DEFAULT_BLOCK
from txl_deploy.exporters.precision.report import accuracy_report, evaluate_against_fp32
from txl_deploy.exporters.precision.token_data import ids_from, segment_len
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

logger = logging.getLogger(__name__)


def int4_graph(fp32: Path, block: int, **kw) -> tuple[Path, dict]:
    """The int4 conversion of `fp32` by txl-deploy's converter, cached under a name keyed by the converter's code."""
    out = fp32.with_name(fp32.stem + f"-int4-b{block}-{harness.code_key(precision, folding, int4)}.onnx")
    if not out.exists():
        t0 = time.perf_counter()
        precision.reduce_onnx(fp32, out, precision="int4", int4_block_size=block, force=True, **kw)
        print(f"int4 conversion of {fp32.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out, read_onnx_info(out).export["precision_report"]


def accuracy(block: int, work: Path) -> dict:
    fp32 = work / "kjv-char.onnx"
    if not fp32.exists():
        export_onnx(DEMO_DIR / "kjv-char", fp32, max_segment=128, force=True)
    int4, report = int4_graph(fp32, block, eval_data=DEMO_DIR / "heldout.txt")
    return {"fp32_path": fp32, "int4_path": int4, "report": report}


def wt103_paths(block: int, work: Path) -> dict:
    fp32 = standin_onnx(standin_checkpoint("wt103-base", work), work, 640, max_segment=64)
    # random weights: the stream comparison is recorded, not enforced (the gate is for trained models)
    int4, report = int4_graph(fp32, block, verify=False)
    return {"fp32": fp32, "int4": int4, "report": report}


def child_resident(path: str, threads: str, prepack: str) -> int:
    """In a fresh process: what loading the graph and one decode step add to its resident set."""
    before = rss_bytes()
    open_runtime(path, int(threads), prepack == "1").step(np.zeros((1, 1), dtype=np.int64))
    return rss_bytes() - before


def open_runtime(path, threads: int, prepack: bool = False, lazy: bool = True):
    """ONNX Runtime's prepacking off (the shared weight pool, as `TxlRuntime.load` opens fp32) or on (each session
    its own packed weights, its default for int4); `lazy` as TxlRuntime's."""
    return TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=threads, prepack=prepack), lazy=lazy)


def sides_of(fp32, int4, others: dict) -> dict:
    """{side: (graph, prepack)}: fp32, int4 unpacked and prepacked, the other block sizes' int4 prepacked."""
    return {"fp32": (fp32, False), "int4": (int4, False), "int4, prepacked": (int4, True),
            **{f"int4, block {b}, prepacked": (path, True) for b, path in others.items()}}


def decode_speed(sides: dict, threads: int, steps: int, seed: int = 0, profile: bool = False) -> dict:
    """ms per decode token of each side ({name: (graph, prepack)}), memory full, the sides taking turns token by
    token; the resident size each adds to a fresh process; with `profile`, where a step goes by operator type."""
    runtimes = {name: open_runtime(path, threads, prepack) for name, (path, prepack) in sides.items()}
    loaded = {name: harness.in_fresh_process("int4", path, threads, int(prepack))
              for name, (path, prepack) in sides.items()}
    tokens, _ = harness.fill_memories(runtimes, steps, np.random.default_rng(seed))
    times = harness.interleaved({name: lambda k, rt=rt: harness.seconds(lambda: rt.step([[int(tokens[k])]]))
                                 for name, rt in runtimes.items()}, steps)
    profiles = {}
    for name, rt in runtimes.items():  # the profiler opens each graph as the runtime does: fp32 and prepacked
        if profile and (name == "fp32" or sides[name][1]):
            state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
            profiles[name] = profile_decode(sides[name][0], state, tokens[None, :7], threads=threads, steps=5)
        rt.close()
    return {"profiles": profiles, "median_ms": {k: 1e3 * harness.median(v) for k, v in times.items()},
            "p90_ms": {k: 1e3 * float(np.percentile(v, 90)) for k, v in times.items()},
            "loaded_rss_mb": {k: v / 1e6 for k, v in loaded.items()},
            "file_mb": {k: Path(p).stat().st_size / 1e6 for k, (p, _) in sides.items()},
            "prepack": {k: bool(pp) for k, (_, pp) in sides.items()}}


def generate_speed(sides: dict, threads: int, tokens: int, rounds: int, seed: int = 0) -> dict:
    """Tokens per second of `TxlRuntime.generate` (batch 1, greedy) per side ({name: (graph, prepack, lazy)}), from
    the same full memory and prompt every round, the sides taking turns."""
    runtimes = {name: open_runtime(path, threads, prepack, lazy=lazy) for name, (path, prepack, lazy) in sides.items()}
    for name, rt in runtimes.items():
        if sides[name][2] and rt.backend.clusters is None:
            raise SystemExit(f"{sides[name][0]}: no softmax parts open ({rt.backend.parts_error}); export it again")
    rng = np.random.default_rng(seed)
    _, saved = harness.fill_memories(runtimes, 0, rng)
    prompt = [int(rng.integers(0, next(iter(runtimes.values())).n_token))]
    for rt in runtimes.values():
        list(rt.generate(prompt, max_new_tokens=2, temperature=0))  # first-run allocations of every graph

    def side(name):
        def run(_):
            runtimes[name].load_state(saved[name])
            t0 = time.perf_counter()
            n = len(list(runtimes[name].generate(prompt, max_new_tokens=tokens, temperature=0)))
            return n / (time.perf_counter() - t0)
        return run

    rates = harness.interleaved({name: side(name) for name in runtimes}, rounds)
    for rt in runtimes.values():
        rt.close()
    return {"tokens_per_s": {k: harness.median(v) for k, v in rates.items()}, "rounds": rates, "tokens": tokens}


def prepacked_accuracy(acc: dict) -> dict:
    """The demo model's held-out bits per character of the int4 graph prepacked (accuracy_level 4's int8-compute
    kernels; unpacked, MatMulNBits multiplies in fp32, which the export's own evaluation measured), against fp32."""
    info = read_onnx_info(acc["fp32_path"])
    ids = ids_from(DEMO_DIR / "heldout.txt", info, "evaluation text")[0]
    rt, r32 = open_runtime(acc["int4_path"], 1, prepack=True), open_runtime(acc["fp32_path"], 1)
    try:
        return accuracy_report(evaluate_against_fp32(rt, r32, ids, segment_len(info), progress=False), info.vocab.kind)
    finally:
        rt.close(), r32.close()


def _accuracy_row(graph: str, a: dict, kl, mb: float) -> list:
    return [graph, f"{a['reduced']:.4f}", f"{100 * a['relative_change']:+.3f}%", f"{a['top1_agreement']:.4f}",
            "" if kl is None else f"{kl:.3g}", f"{mb:.2f}"]


def measure(args, command):
    work = Path(args.cache_dir)
    work.mkdir(parents=True, exist_ok=True)
    others = [int(b) for b in args.other_blocks.split(",") if b.strip()]
    load_start = harness.load_average()
    acc = accuracy(args.block_size, work)
    acc_packed = prepacked_accuracy(acc)
    wt = wt103_paths(args.block_size, work)
    acc_other = {b: accuracy(b, work) for b in others}
    acc_other_packed = {b: prepacked_accuracy(o) for b, o in acc_other.items()}
    wt_other = {b: wt103_paths(b, work) for b in others}
    speed_wt = decode_speed(sides_of(wt["fp32"], wt["int4"], {b: o["int4"] for b, o in wt_other.items()}),
                            args.threads, args.steps, profile=True)
    speed_demo = decode_speed(sides_of(acc["fp32_path"], acc["int4_path"],
                                       {b: o["int4_path"] for b, o in acc_other.items()}), args.threads, args.steps)
    gen = None
    if args.generate_tokens > 0:
        gen = generate_speed({f"{g}, {'lazy' if lazy else 'full'}": (path, prepack, lazy)
                              for g, (path, prepack) in sides_of(wt["fp32"], wt["int4"], {}).items()
                              for lazy in ((False, True) if g == "fp32" else (True, False))},
                             args.threads, args.generate_tokens, args.generate_rounds)
    load_end = harness.load_average()

    a, ap_, s = acc["report"]["accuracy"], acc_packed, acc["report"]["stream"]
    fp32_ms = speed_wt["median_ms"]["fp32"]
    speedup, speedup_packed = fp32_ms / speed_wt["median_ms"]["int4"], fp32_ms / speed_wt["median_ms"]["int4, prepacked"]
    ratio = speed_wt["file_mb"]["fp32"] / speed_wt["file_mb"]["int4"]
    targets = [("demo model: held-out bits per character within 2% of fp32 (int4 unpacked)",
                f"{100 * a['relative_change']:+.2f}%", abs(a["relative_change"]) <= 0.02),
               ("demo model: the same, int4 prepacked (as the runtime runs it)",
                f"{100 * ap_['relative_change']:+.2f}%", abs(ap_["relative_change"]) <= 0.02),
               ("WikiText-103 base: decode >= 3x fp32, int4 unpacked", f"{speedup:.2f}x", speedup >= 3),
               ("WikiText-103 base: decode >= 3x fp32, int4 prepacked (both as the runtime runs them)",
                f"{speedup_packed:.2f}x", speedup_packed >= 3),
               ("WikiText-103 base: file <= 1/6 of fp32", f"1/{ratio:.2f}", ratio >= 6)]
    method, mb = acc["report"]["method"], speed_demo["file_mb"]
    lines = [
        *harness.machine_lines(load_start, load_end),
        f"- int4: block size {method['block_size']}, accuracy_level {method['accuracy_level']} (int8 compute), "
        f"{'symmetric' if method['symmetric'] else 'asymmetric (4-bit zero points)'}, the adaptive-softmax "
        "output layer included, the tied embedding reading its blocks, scales and positional tables stored in "
        "fp16; memory state fp32",
        f"- speed: ONNX Runtime CPU, {args.threads} intra-op thread(s) on every side, batch 1, memory full, median of "
        f"{args.steps} decode steps per side, the sides taking turns token by token",
        "", "## Targets", "", *harness.targets_table(targets), "",
        "## Accuracy (demo model `kjv-char`, its whole held-out text)", "",
        *harness.table(["graph", "bits per character", "change", "top-1 agreement", "stream KL vs fp32 (nats)",
                        "file MB"],
                       [["fp32", f"{a['fp32']:.4f}", "", "", "", f"{mb['fp32']:.2f}"],
                        _accuracy_row("int4", a, s["kl_divergence"], mb["int4"]),
                        _accuracy_row("int4, prepacked", ap_, None, mb["int4"]),
                        *[_accuracy_row(f"int4, block {b}", o["report"]["accuracy"],
                                        o["report"]["stream"]["kl_divergence"], mb[f"int4, block {b}, prepacked"])
                          for b, o in acc_other.items()],
                        *[_accuracy_row(f"int4, block {b}, prepacked", o, None, mb[f"int4, block {b}, prepacked"])
                          for b, o in acc_other_packed.items()]]),
        "",
        f"{a['tokens']} held-out characters, streaming evaluation; the stream comparison is the export-time check, "
        "run as the runtime runs the graph.",
        "", "## Decode speed and size", "",
        *harness.table(["shape", "side", "ms / token (p50)", "p90", "speed-up", "file MB", "resident MB"],
                       [[shape, g, f"{sp['median_ms'][g]:.2f}", f"{sp['p90_ms'][g]:.2f}",
                         f"{sp['median_ms']['fp32'] / sp['median_ms'][g]:.2f}x", f"{sp['file_mb'][g]:.1f}",
                         f"{sp['loaded_rss_mb'][g]:.1f}"]
                        for shape, sp in (("WikiText-103 base (mem_len 640)", speed_wt),
                                          ("demo model (mem_len 128)", speed_demo)) for g in sp["median_ms"]]),
    ]
    wr = wt["report"]["stream"]
    lines += ["", f"WikiText-103 base stand-in int4 vs fp32 on the export-time stream: KL {wr['kl_divergence']:.3g} "
              f"nats per position, top-1 agreement {wr['top1_agreement']:.3f} (random weights: top-1 is fragile).",
              "", "Where a WikiText-103 base decode step goes (ONNX Runtime profiler, one thread, median of 5 steps; "
              "MatMulNBits: the 4-bit weight products):", ""]
    for g, prof in speed_wt["profiles"].items():
        lines += [f"{g}:", "", "```", profile_table(prof, 8), "```", ""]
    graphs = {"fp32": wt["fp32"], "int4": wt["int4"], **{f"int4, block {b}": wt_other[b]["int4"] for b in others}}
    reads = {g: graph_step_bytes(path) for g, path in graphs.items()}
    measured = {g: g if g == "fp32" else f"{g}, prepacked" for g in graphs}
    lines += ["What a WikiText-103 base decode step reads, and the speed-up those bytes bound:", "",
              *harness.table(["graph", "weight products MB", "positional tables MB", "memory MB", "total MB",
                              "bound on the speed-up", "measured speed-up (prepacked)"],
                             [[g, *(f"{r[k] / 1e6:.1f}" for k in ("weights", "positional_tables", "memory", "total")),
                               f"{reads['fp32']['total'] / r['total']:.2f}x",
                               f"{fp32_ms / speed_wt['median_ms'][measured[g]]:.2f}x"] for g, r in reads.items()]),
              "", "Each int4 step against the read and copy of its own bytes: results_efficiency.md.", ""]
    if gen is not None:
        full = gen["tokens_per_s"]["fp32, full"]
        lines += [f"WikiText-103 base generation, batch 1, greedy: `TxlRuntime.generate` of {gen['tokens']} tokens "
                  f"from a full memory, {args.generate_rounds} rounds, lazy and full:", "",
                  *harness.table(["side", "tokens / s", "against fp32 full"],
                                 [[g, f"{r:.2f}", f"{r / full:.2f}x"] for g, r in gen["tokens_per_s"].items()]), ""]
    raw = {"accuracy": acc["report"], "accuracy_prepacked": acc_packed,
           "accuracy_other_blocks": {b: o["report"] for b, o in acc_other.items()},
           "accuracy_other_blocks_prepacked": acc_other_packed,
           "speed_wt103": speed_wt, "speed_demo": speed_demo, "step_bytes": reads,
           "wt103_stream": wt["report"]["stream"], "targets": [list(t) for t in targets], "command": command,
           "load_start": load_start, "load_end": load_end, "generate": gen}
    for t, val, ok in targets:
        logger.info(f"{'ok ' if ok else 'MISS'} {t}: {val}")
    return harness.results_markdown("int4 weight-only graphs (MatMulNBits)", "\n".join(lines), command), raw, 0


def main(argv=None) -> int:
    p = harness.parser("int4", __doc__, md="results_int4.md")
    others = ",".join(str(b) for b in (32, 64, 128) if b != INT4_DEFAULT_BLOCK)
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per side")
    p.add_argument("--block-size", type=int, default=INT4_DEFAULT_BLOCK, help="int4 block size (the export default)")
    p.add_argument("--other-blocks", default=others, help=f"further block sizes, prepacked (default {others})")
    p.add_argument("--generate-tokens", type=int, default=16, help="tokens per side per round of generation (0: skip)")
    p.add_argument("--generate-rounds", type=int, default=3, help="rounds of the generation speed")
    return harness.main("int4", p, measure, argv)


if __name__ == "__main__":
    sys.exit(0 if harness.child_main(child_resident) else main())
