"""int4 weight-only graphs (MatMulNBits) against fp32: accuracy on the demo model, file size, decode speed and what
a step reads on the WikiText-103 base shape, prepacked and not, other block sizes beside the default, generation
lazy and full. Method: docs/edge.md ("int4") and docs/benchmarks.md ("Decode efficiency")."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.step_bytes import EFFICIENCY_HEAD, efficiency_cells, graph_step_bytes, interleaved_efficiency
from txl_deploy.assets import DEMO_DIR
from txl_deploy.bench.bandwidth_floor import BandwidthProbe
from txl_deploy.bench.op_profile import profile_decode, profile_table
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


def _int4(fp32: Path, block: int, **kw) -> tuple[Path, dict]:
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
    int4, report = _int4(fp32, block, eval_data=DEMO_DIR / "heldout.txt")
    return {"fp32_path": fp32, "int4_path": int4, "report": report}


def child_resident(path: str, threads: str, prepack: str) -> int:
    """In a fresh process (`resident_bytes`): what loading the graph and one decode step add to its resident set."""
    before = harness.process_memory()["VmRSS"]
    rt = TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=int(threads), prepack=prepack == "1"))
    rt.step(np.zeros((1, 1), dtype=np.int64))
    return harness.process_memory()["VmRSS"] - before


def resident_bytes(path, threads: int, prepack: bool = False) -> int:
    """What loading the graph and one decode step add to a fresh process's resident set (weights as the runtime
    holds them, prepacked kernels' copies included where `prepack`)."""
    return harness.in_fresh_process("int4", path, threads, int(prepack))


def open_runtime(path, threads: int, prepack: bool = False, lazy: bool = True):
    """A TxlRuntime over the graph with ONNX Runtime's prepacking off (the shared weight pool: what `TxlRuntime.load`
    opens for fp32) or on (`prepack`: each session its own packed weights, its default for int4); `lazy` as
    TxlRuntime's (generate computes the softmax's head first and tails on demand where the graph has parts)."""

    return TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=threads, prepack=prepack), lazy=lazy)


def decode_speed(sides: dict, threads: int, steps: int, seed: int = 0, profile: bool = False) -> dict:
    """Median ms per decode token of each side ({name: (graph path, prepack)}), with a full memory, interleaved
    token by token."""
    runtimes = {name: open_runtime(path, threads, prepack) for name, (path, prepack) in sides.items()}
    loaded = {name: resident_bytes(path, threads, prepack) for name, (path, prepack) in sides.items()}
    tokens, _ = harness.fill_memories(runtimes, steps, np.random.default_rng(seed))
    times = harness.interleaved({name: lambda k, rt=rt: harness.seconds(lambda: rt.step([[int(tokens[k])]]))
                                 for name, rt in runtimes.items()}, steps)
    profiles = {}
    if profile:  # where a step's time goes, by operator type (ONNX Runtime's profiler, median of steps)

        for name, rt in runtimes.items():
            if name != "fp32" and not sides[name][1]:  # the profiler opens each graph as the runtime does
                continue
            state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
            profiles[name] = profile_decode(sides[name][0], state, tokens[None, :7], threads=threads, steps=5)
    for rt in runtimes.values():
        rt.close()
    return {"profiles": profiles, "median_ms": {k: 1e3 * float(np.median(v)) for k, v in times.items()},
            "p90_ms": {k: 1e3 * float(np.percentile(v, 90)) for k, v in times.items()},
            "loaded_rss_mb": {k: v / 1e6 for k, v in loaded.items()},
            "file_mb": {k: Path(p).stat().st_size / 1e6 for k, (p, _) in sides.items()},
            "prepack": {k: bool(pp) for k, (_, pp) in sides.items()}}


def against_own_bytes(sides: dict, threads: int, rounds: int = 9, steps_per_round: int = 6, seed: int = 0) -> dict:
    """Each side's decode step ({name: (graph path, prepack)}, memory full) against the plain read and the copy
    floor of the bytes that graph's step reads, in wall and in CPU time, one intra-op thread and the probe's one
    thread, the sides' steps and the probes taking turns round by round (`interleaved_efficiency`)."""
    rng = np.random.default_rng(seed)
    runtimes, steps = {}, {}
    for name, (path, prepack) in sides.items():
        rt = runtimes[name] = open_runtime(path, threads, prepack)
        rt.prefill(rng.integers(0, rt.n_token, size=(1, rt.mem_len)))
        tokens = iter(rng.integers(0, rt.n_token, size=100_000).tolist())
        steps[name] = (lambda rt=rt, tokens=tokens: rt.step([[next(tokens)]]))
        steps[name](), steps[name]()  # first-run allocations
    out = interleaved_efficiency(steps, {name: graph_step_bytes(p)["total"] for name, (p, _) in sides.items()},
                                 BandwidthProbe(), rounds, steps_per_round)
    for rt in runtimes.values():
        rt.close()
    return out


def generate_speed(sides: dict, threads: int, tokens: int, rounds: int, seed: int = 0) -> dict:
    """Generated tokens per second of each side ({name: (graph path, prepack, lazy)}) at batch 1, greedy, from the
    same full memory and prompt token every round (sides taking turns, the order reversed every other round):
    `TxlRuntime.generate` as a user calls it, lazily (the head graph per token, a tail only when the decision
    needs it) where `lazy` and the graph has softmax parts, else the full graph per token."""
    runtimes, saved = {}, {}
    rng = np.random.default_rng(seed)
    for name, (path, prepack, lazy) in sides.items():
        rt = runtimes[name] = open_runtime(path, threads, prepack, lazy=lazy)
        if lazy and rt.backend.clusters is None:
            raise SystemExit(f"{path}: no softmax parts open ({rt.backend.parts_error}); export it again")
    rt0 = next(iter(runtimes.values()))
    context = rng.integers(0, rt0.n_token, size=(1, rt0.mem_len))
    prompt = [int(rng.integers(0, rt0.n_token))]
    for name, rt in runtimes.items():
        rt.prefill(context)
        saved[name] = rt.save_state()
        list(rt.generate(prompt, max_new_tokens=2, temperature=0))  # first-run allocations
    rates = {name: [] for name in runtimes}
    for k in range(rounds):
        order = list(runtimes.items()) if k % 2 == 0 else list(runtimes.items())[::-1]
        for name, rt in order:
            rt.load_state(saved[name])
            t0 = time.perf_counter()
            out = list(rt.generate(prompt, max_new_tokens=tokens, temperature=0))
            rates[name].append(len(out) / (time.perf_counter() - t0))
    for rt in runtimes.values():
        rt.close()
    return {"tokens_per_s": {k: float(np.median(v)) for k, v in rates.items()}, "rounds": rates, "tokens": tokens}


def prepacked_accuracy(acc: dict) -> dict:
    """The demo model's held-out bits per character of the int4 graph run with ONNX Runtime's prepacking on (the
    int8-compute kernels of accuracy_level 4; without prepacking MatMulNBits dequantizes its weights to fp32 and
    multiplies in fp32, which is what the export's own evaluation measured), against fp32 as the runtime runs it."""

    info = read_onnx_info(acc["fp32_path"])
    ids = ids_from(DEMO_DIR / "heldout.txt", info, "evaluation text")[0]
    rt, r32 = open_runtime(acc["int4_path"], 1, prepack=True), open_runtime(acc["fp32_path"], 1)
    try:
        return accuracy_report(evaluate_against_fp32(rt, r32, ids, segment_len(info), progress=False), info.vocab.kind)
    finally:
        rt.close(), r32.close()


def wt103_paths(block: int, work: Path) -> dict:

    ckpt = standin_checkpoint("wt103-base", work)
    fp32 = standin_onnx(ckpt, work, 640, max_segment=64)
    # random weights: the stream comparison is recorded, not enforced (the gate is for trained models)
    int4, report = _int4(fp32, block, verify=False)
    return {"fp32": fp32, "int4": int4, "report": report}


def _resident(mb: float) -> str:
    return f"{mb:.1f}"


def measure(args, command):
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    others = [int(b) for b in args.other_blocks.split(",") if b.strip()]
    load_start = harness.load_average()
    acc = accuracy(args.block_size, Path(args.cache_dir))
    acc_packed = prepacked_accuracy(acc)
    wt = wt103_paths(args.block_size, Path(args.cache_dir))
    acc_other = {b: accuracy(b, Path(args.cache_dir)) for b in others}
    acc_other_packed = {b: prepacked_accuracy(o) for b, o in acc_other.items()}
    wt_other = {b: wt103_paths(b, Path(args.cache_dir)) for b in others}
    speed_wt = decode_speed({"fp32": (wt["fp32"], False), "int4": (wt["int4"], False),
                             "int4, prepacked": (wt["int4"], True),
                             **{f"int4, block {b}, prepacked": (wt_other[b]["int4"], True) for b in others}},
                            args.threads, args.steps, profile=True)
    speed_demo = decode_speed({"fp32": (acc["fp32_path"], False), "int4": (acc["int4_path"], False),
                               "int4, prepacked": (acc["int4_path"], True),
                               **{f"int4, block {b}, prepacked": (acc_other[b]["int4_path"], True) for b in others}},
                              args.threads, args.steps)
    own = against_own_bytes({"fp32": (wt["fp32"], False), "int4": (wt["int4"], False),
                             "int4, prepacked": (wt["int4"], True)}, args.threads, args.rounds, args.steps_per_round)
    gen = None
    if args.generate_tokens > 0:
        gen = generate_speed({"fp32, full": (wt["fp32"], False, False), "fp32, lazy": (wt["fp32"], False, True),
                              "int4, lazy": (wt["int4"], False, True), "int4, full": (wt["int4"], False, False),
                              "int4, prepacked, lazy": (wt["int4"], True, True),
                              "int4, prepacked, full": (wt["int4"], True, False)},
                             args.threads, args.generate_tokens, args.generate_rounds)
    load_end = harness.load_average()

    a, ap_ = acc["report"]["accuracy"], acc_packed
    s = acc["report"]["stream"]
    fp32_ms = speed_wt["median_ms"]["fp32"]
    speedup, speedup_packed = fp32_ms / speed_wt["median_ms"]["int4"], fp32_ms / speed_wt["median_ms"]["int4, prepacked"]
    ratio = speed_wt["file_mb"]["fp32"] / speed_wt["file_mb"]["int4"]
    targets = [("demo model: held-out bits per character within 2% of fp32 (int4 unpacked)",
                f"{100 * a['relative_change']:+.2f}%", abs(a["relative_change"]) <= 0.02),
               ("demo model: the same, int4 prepacked (as the runtime runs it)", f"{100 * ap_['relative_change']:+.2f}%",
                abs(ap_["relative_change"]) <= 0.02),
               ("WikiText-103 base: decode >= 3x fp32, int4 unpacked", f"{speedup:.2f}x", speedup >= 3),
               ("WikiText-103 base: decode >= 3x fp32, int4 prepacked (both as the runtime runs them)", f"{speedup_packed:.2f}x", speedup_packed >= 3),
               ("WikiText-103 base: file <= 1/6 of fp32", f"1/{ratio:.2f}", ratio >= 6)]
    method = acc["report"]["method"]
    lines = [
        *harness.machine_lines(load_start, load_end),
        f"- int4: block size {method['block_size']}, accuracy_level {method['accuracy_level']} (int8 compute), "
        f"{'symmetric' if method['symmetric'] else 'asymmetric (4-bit zero points)'}, the adaptive-softmax "
        "output layer included, the tied embedding reading its blocks, scales and positional tables stored in "
        "fp16; memory state fp32",
        "- sides: `fp32` and `int4, prepacked` as `TxlRuntime.load` runs each graph, `int4` with "
        "`OrtBackend(prepack=False)` (see docs/benchmarks.md, \"int4\")",
        f"- speed: ONNX Runtime CPU, {args.threads} intra-op thread(s) on every side, batch 1, memory full, median of "
        f"{args.steps} decode steps per side, the sides taking turns token by token",
        "",
        "## Targets",
        "",
        *harness.targets_table(targets),
        "",
        "## Accuracy (demo model `kjv-char`, its whole held-out text)",
        "",
        "| graph | bits per character | change | top-1 agreement | stream KL vs fp32 (nats) | file MB |",
        "|---|---|---|---|---|---|",
        f"| fp32 | {a['fp32']:.4f} | | | | {speed_demo['file_mb']['fp32']:.2f} |",
        f"| int4 | {a['reduced']:.4f} | {100 * a['relative_change']:+.3f}% | {a['top1_agreement']:.4f} | "
        f"{s['kl_divergence']:.3g} | {speed_demo['file_mb']['int4']:.2f} |",
        f"| int4, prepacked | {ap_['reduced']:.4f} | {100 * ap_['relative_change']:+.3f}% | "
        f"{ap_['top1_agreement']:.4f} | | {speed_demo['file_mb']['int4']:.2f} |",
        *[f"| int4, block {b} | {o['report']['accuracy']['reduced']:.4f} | "
          f"{100 * o['report']['accuracy']['relative_change']:+.3f}% | {o['report']['accuracy']['top1_agreement']:.4f} "
          f"| {o['report']['stream']['kl_divergence']:.3g} | "
          f"{speed_demo['file_mb'][f'int4, block {b}, prepacked']:.2f} |" for b, o in acc_other.items()],
        *[f"| int4, block {b}, prepacked | {o['reduced']:.4f} | {100 * o['relative_change']:+.3f}% | "
          f"{o['top1_agreement']:.4f} | | {speed_demo['file_mb'][f'int4, block {b}, prepacked']:.2f} |"
          for b, o in acc_other_packed.items()],
        "",
        f"{a['tokens']} held-out characters, streaming evaluation (segments of the training length, memory "
        "threaded); the stream comparison is the export-time check (random tokens, prefill and decode, ring wrap), "
        "run as the runtime runs the graph.",
        "",
        "## Decode speed and size",
        "",
        "| shape | side | ms / token (p50) | p90 | speed-up | file MB | resident MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, sp in (("WikiText-103 base (mem_len 640)", speed_wt), ("demo model (mem_len 128)", speed_demo)):
        for g in sp["median_ms"]:
            lines.append(f"| {shape} | {g} | {sp['median_ms'][g]:.2f} | {sp['p90_ms'][g]:.2f} | "
                         f"{sp['median_ms']['fp32'] / sp['median_ms'][g]:.2f}x | {sp['file_mb'][g]:.1f} | "
                         f"{_resident(sp['loaded_rss_mb'][g])} |")
    wr = wt["report"]["stream"]
    lines += ["", "Resident after load: what the sessions and one decode step add to a fresh process.", "",
              f"WikiText-103 base stand-in (random weights) int4 vs fp32 on the export-time stream: KL "
              f"{wr['kl_divergence']:.3g} nats per position, top-1 agreement {wr['top1_agreement']:.3f} (random "
              "weights give near-uniform distributions over 267,735 words, where top-1 is fragile; the accuracy "
              "that matters is the trained demo model's above)."]
    lines += ["", "Where a WikiText-103 base decode step goes, as the runtime runs each graph (ONNX Runtime profiler, "
              "one thread, median of 5 steps; MatMulNBits are the 4-bit weight products, MatMul in the int4 graph "
              "the fp32 attention over the fp32 memory and the positional tables):", ""]
    for g in speed_wt["profiles"]:
        lines += [f"{g}:", "", "```", profile_table(speed_wt["profiles"][g], 8), "```", ""]
    graphs = {"fp32": wt["fp32"], "int4": wt["int4"], **{f"int4, block {b}": wt_other[b]["int4"] for b in others}}
    reads = {g: graph_step_bytes(path) for g, path in graphs.items()}
    measured = {"fp32": "fp32", "int4": "int4, prepacked", **{g: f"{g}, prepacked" for g in graphs if "block" in g}}
    lines += ["What a WikiText-103 base decode step reads, counted from each graph, and the speed-up those bytes "
              "bound (fp32's over the graph's) beside the one measured, prepacked:", "",
              "| graph | weight products MB | positional tables MB | memory MB | total MB | bound on the speed-up "
              "| measured speed-up (prepacked) |",
              "|---|---|---|---|---|---|---|",
              *[f"| {g} | {r['weights'] / 1e6:.1f} | {r['positional_tables'] / 1e6:.1f} | {r['memory'] / 1e6:.1f} | "
                f"{r['total'] / 1e6:.1f} | {reads['fp32']['total'] / r['total']:.2f}x | "
                f"{fp32_ms / speed_wt['median_ms'][measured[g]]:.2f}x |" for g, r in reads.items()], ""]
    lines += [f"Each WikiText-103 base step against the plain read and the copy of its own bytes, {args.rounds} rounds "
              f"of {args.steps_per_round} steps of each side, then the probes (as decode_efficiency measures them):",
              "",
              *harness.table(["side", *EFFICIENCY_HEAD], [[g, *efficiency_cells(r)] for g, r in own.items()]), ""]
    if gen is not None:
        full = gen["tokens_per_s"]["fp32, full"]
        lines += [f"WikiText-103 base generation, batch 1, greedy: `TxlRuntime.generate` of {gen['tokens']} tokens from "
                  f"a full memory, {args.generate_rounds} rounds, lazy (the softmax parts) and full (the main graph); "
                  "random weights need tails far more often than a trained model (see lazy_decode):", "",
                  "| side | tokens / s | against fp32 full |", "|---|---|---|",
                  *[f"| {g} | {r:.2f} | {r / full:.2f}x |" for g, r in gen["tokens_per_s"].items()], ""]
    text = harness.results_markdown("int4 weight-only graphs (MatMulNBits)", "\n".join(lines), command)
    raw = {"against_own_bytes": own, "accuracy": acc["report"], "accuracy_prepacked": acc_packed,
           "accuracy_other_blocks": {b: o["report"] for b, o in acc_other.items()},
           "accuracy_other_blocks_prepacked": acc_other_packed,
           "speed_wt103": speed_wt, "speed_demo": speed_demo, "step_bytes": reads,
           "wt103_stream": wt["report"]["stream"], "targets": [list(t) for t in targets], "command": command,
           "load_start": load_start, "load_end": load_end, "generate": gen}
    for t, val, ok in targets:
        logger.info(f"{'ok ' if ok else 'MISS'} {t}: {val}")
    return text, raw, 0


def main(argv=None) -> int:
    p = harness.parser("int4", __doc__, md="results_int4.md")
    others = ",".join(str(b) for b in (32, 64, 128) if b != INT4_DEFAULT_BLOCK)
    p.add_argument("--steps", type=int, default=128, help="decode steps timed per side")
    p.add_argument("--block-size", type=int, default=INT4_DEFAULT_BLOCK, help="int4 block size (the export default)")
    p.add_argument("--other-blocks", default=others, help=f"further block sizes, prepacked (default {others})")
    p.add_argument("--rounds", type=int, default=9, help="rounds of the steps-against-their-bytes comparison")
    p.add_argument("--steps-per-round", type=int, default=6, help="decode steps per side per round")
    p.add_argument("--generate-tokens", type=int, default=16, help="tokens per side per round of generation (0: skip)")
    p.add_argument("--generate-rounds", type=int, default=3, help="rounds of the generation speed")
    return harness.main("int4", p, measure, argv)


if __name__ == "__main__":
    sys.exit(0 if harness.child_main(child_resident) else main())
