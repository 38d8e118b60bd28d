"""int4 weight-only graphs against fp32, measured in one run: accuracy, decode speed and file size.

    .venv/bin/python benchmarks/int4.py [--threads 1] [--steps 64] [--block-size 32] [--out benchmarks/results_int4.md]

- accuracy: the demo model's bits per character on its whole held-out text, fp32 and int4 (ONNX Runtime CPU,
  streaming evaluation with the memory), with the stream comparison (KL divergence, top-1 agreement);
- speed: ONNX Runtime CPU decode time per token with a full memory (mem_len tokens fed first) on the
  WikiText-103 base shape (random weights: speed depends on shapes, not values) and on the demo model, fp32 and
  int4 in one process, alternating token by token, the same intra-op thread count on both sides; medians;
- size: the files, and the resident memory each session added when it loaded.

Targets: demo bits per character within 2% of fp32; WikiText-103 base decode >= 3x fp32; file <= 1/6 of fp32 (at
the export's default block size; the others are measured beside it). The profiles of every graph and the bytes a
step reads show where an int4 step's time goes.
Writes a Markdown file (header: command, machine, date) and the raw numbers as JSON beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

from txl_deploy.bench.bandwidth_floor import BandwidthProbe, graph_step_bytes, interleaved_efficiency

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"



def _int4(fp32: Path, block: int, **kw) -> tuple[Path, dict]:
    """The int4 conversion of `fp32` by txl-deploy's converter, cached under a name keyed by the converter's code."""
    import hashlib

    from txl_deploy.contract.metadata import read_onnx_info
    from txl_deploy.exporters.precision import convert as precision
    from txl_deploy.exporters.precision import folding, int4

    code = hashlib.sha256(b"".join(Path(m.__file__).read_bytes() for m in (precision, folding, int4))).hexdigest()[:8]
    out = fp32.with_name(fp32.stem + f"-int4-b{block}-{code}.onnx")
    if not out.exists():
        t0 = time.perf_counter()
        precision.reduce_onnx(fp32, out, precision="int4", int4_block_size=block, force=True, **kw)
        print(f"int4 conversion of {fp32.name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return out, read_onnx_info(out).export["precision_report"]


def accuracy(block: int, work: Path) -> dict:
    from txl_deploy.assets import DEMO_DIR
    from txl_deploy.exporters.onnx.export import export_onnx

    fp32 = work / "kjv-char.onnx"
    if not fp32.exists():
        export_onnx(DEMO_DIR / "kjv-char", fp32, max_segment=128, force=True)
    int4, report = _int4(fp32, block, eval_data=DEMO_DIR / "heldout.txt")
    return {"fp32_path": fp32, "int4_path": int4, "report": report}


_RESIDENT = """
import json, sys
import numpy as np
from txl_deploy.bench.peak_usage import rss_bytes
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend
before = rss_bytes()
rt = TxlRuntime(OrtBackend(sys.argv[1], providers=["cpu"], intra_op_threads=int(sys.argv[2])))
rt.step(np.zeros((1, 1), dtype=np.int64))
print(json.dumps(rss_bytes() - before))
"""


def resident_bytes(path, threads: int) -> int:
    """What loading the graph and one decode step add to a fresh process's resident set (weights as the runtime
    holds them, prepacked kernels' copies included)."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _RESIDENT, str(path), str(threads)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


def decode_speed(paths: dict, threads: int, steps: int, seed: int = 0, profile: bool = False) -> dict:
    """Median ms per decode token of each graph, with a full memory, interleaved token by token."""
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

    runtimes = {}
    for name, path in paths.items():
        runtimes[name] = TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=threads))
    loaded = {name: resident_bytes(path, threads) for name, path in paths.items()}
    rt0 = next(iter(runtimes.values()))
    rng = np.random.default_rng(seed)
    context = rng.integers(0, rt0.n_token, size=(1, rt0.mem_len))
    tokens = rng.integers(0, rt0.n_token, size=steps + 2)
    for rt in runtimes.values():
        rt.prefill(context)  # every timed step attends to mem_len cached positions
        rt.step([[int(tokens[0])]])  # first-run allocations
        rt.step([[int(tokens[1])]])
    times = {name: [] for name in runtimes}
    for k, tok in enumerate(tokens[2:]):
        order = list(runtimes.items()) if k % 2 == 0 else list(runtimes.items())[::-1]  # A B, B A, ...
        for name, rt in order:
            t0 = time.perf_counter()
            rt.step([[int(tok)]])
            times[name].append(time.perf_counter() - t0)
    profiles = {}
    if profile:  # where a step's time goes, by operator type (ONNX Runtime's profiler, median of steps)
        from txl_deploy.bench.op_profile import profile_decode

        for name, rt in runtimes.items():
            state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
            profiles[name] = profile_decode(paths[name], state, tokens[None, :7], threads=threads, steps=5)
    for rt in runtimes.values():
        rt.close()
    return {"profiles": profiles, "median_ms": {k: 1e3 * float(np.median(v)) for k, v in times.items()},
            "p90_ms": {k: 1e3 * float(np.percentile(v, 90)) for k, v in times.items()},
            "loaded_rss_mb": {k: v / 1e6 for k, v in loaded.items()},
            "file_mb": {k: Path(p).stat().st_size / 1e6 for k, p in paths.items()}}


def against_own_bytes(paths: dict, threads: int, rounds: int = 9, steps_per_round: int = 6, seed: int = 0) -> dict:
    """Each graph's decode step (memory full) against the plain read and the copy floor of the bytes that graph's
    step reads, the graphs' steps and the probes taking turns round by round (`interleaved_efficiency`)."""
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

    rng = np.random.default_rng(seed)
    runtimes, steps = {}, {}
    for name, path in paths.items():
        rt = runtimes[name] = TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=threads))
        rt.prefill(rng.integers(0, rt.n_token, size=(1, rt.mem_len)))
        tokens = iter(rng.integers(0, rt.n_token, size=100_000).tolist())
        steps[name] = (lambda rt=rt, tokens=tokens: rt.step([[next(tokens)]]))
        steps[name](), steps[name]()  # first-run allocations
    out = interleaved_efficiency(steps, {name: graph_step_bytes(p)["total"] for name, p in paths.items()},
                                 BandwidthProbe(), rounds, steps_per_round)
    for rt in runtimes.values():
        rt.close()
    return out


def wt103_paths(block: int) -> dict:
    from txl_deploy.bench.random_weights import standin_checkpoint, standin_onnx

    ckpt = standin_checkpoint("wt103-base", CACHE)
    fp32 = standin_onnx(ckpt, CACHE, 640, max_segment=64)
    # random weights: the stream comparison is recorded, not enforced (the gate is for trained models)
    int4, report = _int4(fp32, block, verify=False)
    return {"fp32": fp32, "int4": int4, "report": report}


def _resident(mb: float) -> str:
    return f"{mb:.1f}"


def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    from txl_deploy.bench.benchmark import machine_info, versions
    from txl_deploy.bench.report import GENERATED_BY

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of both sides (default 1)")
    ap.add_argument("--steps", type=int, default=128, help="decode steps timed per side")
    from txl_deploy.exporters.precision.int4 import INT4_DEFAULT_BLOCK

    others_default = ",".join(str(b) for b in (32, 64, 128) if b != INT4_DEFAULT_BLOCK)
    ap.add_argument("--block-size", type=int, default=INT4_DEFAULT_BLOCK,
                    help=f"int4 block size (default {INT4_DEFAULT_BLOCK}, the export default)")
    ap.add_argument("--other-blocks", default=others_default,
                    help=f"further block sizes measured beside it, comma-separated (default {others_default}; '' "
                         "for none)")
    ap.add_argument("--out", default=str(HERE / "results_int4.md"))
    args = ap.parse_args()
    CACHE.mkdir(exist_ok=True)
    command = "python benchmarks/int4.py" + "".join(f" {a}" for a in sys.argv[1:])
    acc = accuracy(args.block_size, CACHE)
    wt = wt103_paths(args.block_size)
    others = [int(b) for b in args.other_blocks.split(",") if b.strip()]
    acc_other = {b: accuracy(b, CACHE) for b in others}
    wt_other = {b: wt103_paths(b) for b in others}
    speed_wt = decode_speed({"fp32": wt["fp32"], "int4": wt["int4"],
                             **{f"int4, block {b}": wt_other[b]["int4"] for b in others}},
                            args.threads, args.steps, profile=True)
    speed_demo = decode_speed({"fp32": acc["fp32_path"], "int4": acc["int4_path"],
                               **{f"int4, block {b}": acc_other[b]["int4_path"] for b in others}},
                              args.threads, args.steps)

    own = against_own_bytes({"fp32": wt["fp32"], "int4": wt["int4"]}, args.threads)
    a = acc["report"]["accuracy"]
    s = acc["report"]["stream"]
    speedup = speed_wt["median_ms"]["fp32"] / speed_wt["median_ms"]["int4"]
    ratio = speed_wt["file_mb"]["fp32"] / speed_wt["file_mb"]["int4"]
    targets = [("demo model: held-out bits per character within 2% of fp32", f"{100 * a['relative_change']:+.2f}%",
                abs(a["relative_change"]) <= 0.02),
               ("WikiText-103 base: decode >= 3x fp32 ONNX Runtime", f"{speedup:.2f}x", speedup >= 3),
               ("WikiText-103 base: file <= 1/6 of fp32", f"1/{ratio:.2f}", ratio >= 6)]
    m, v = machine_info(), versions()
    method = acc["report"]["method"]
    lines = [
        "# int4 weight-only graphs (MatMulNBits)",
        "",
        f"{GENERATED_BY}{command}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; do not "
        "edit by hand (run the command again).",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores (shared with other jobs), {m['platform']}",
        f"- versions: python {v['python']}, numpy {v['numpy']}, onnxruntime {v['onnxruntime']}, "
        f"txl-deploy {v['txl_deploy']}",
        f"- int4: block size {method['block_size']}, accuracy_level {method['accuracy_level']} (int8 compute), "
        f"{'symmetric' if method['symmetric'] else 'asymmetric (4-bit zero points)'}, the adaptive-softmax "
        "output layer included, the tied embedding reading its blocks, scales and positional tables stored in "
        "fp16; memory state fp32",
        f"- speed: ONNX Runtime CPU, {args.threads} intra-op thread(s) on both sides, batch 1, memory full, median of "
        f"{args.steps} decode steps per side, the two sides alternating token by token",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *[f"| {t} | {val} | {'yes' if ok else 'NO'} |" for t, val, ok in targets],
        "",
        "## Accuracy (demo model `kjv-char`, its whole held-out text)",
        "",
        "| graph | bits per character | change | top-1 agreement | stream KL vs fp32 (nats) | file MB |",
        "|---|---|---|---|---|---|",
        f"| fp32 | {a['fp32']:.4f} | | | | {speed_demo['file_mb']['fp32']:.2f} |",
        f"| int4 | {a['reduced']:.4f} | {100 * a['relative_change']:+.3f}% | {a['top1_agreement']:.4f} | "
        f"{s['kl_divergence']:.3g} | {speed_demo['file_mb']['int4']:.2f} |",
        *[f"| int4, block {b} | {o['report']['accuracy']['reduced']:.4f} | "
          f"{100 * o['report']['accuracy']['relative_change']:+.3f}% | {o['report']['accuracy']['top1_agreement']:.4f} "
          f"| {o['report']['stream']['kl_divergence']:.3g} | {speed_demo['file_mb'][f'int4, block {b}']:.2f} |"
          for b, o in acc_other.items()],
        "",
        f"{a['tokens']} held-out characters, streaming evaluation (segments of the training length, memory "
        "threaded); the stream comparison is the export-time check (random tokens, prefill and decode, ring wrap).",
        "",
        "## Decode speed and size",
        "",
        "| shape | graph | ms / token (p50) | p90 | speed-up | file MB | resident MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape, sp in (("WikiText-103 base (mem_len 640)", speed_wt), ("demo model (mem_len 128)", speed_demo)):
        for g in sp["median_ms"]:
            lines.append(f"| {shape} | {g} | {sp['median_ms'][g]:.2f} | {sp['p90_ms'][g]:.2f} | "
                         f"{sp['median_ms']['fp32'] / sp['median_ms'][g]:.2f}x | {sp['file_mb'][g]:.1f} | "
                         f"{_resident(sp['loaded_rss_mb'][g])} |")
    wr = wt["report"]["stream"]
    lines += ["", "Resident after load: what creating the ONNX Runtime session and one decode step add to a fresh "
              "process's resident set (ONNX Runtime keeps both the tied embedding and the output layer's folded "
              "transpose, and MatMulNBits keeps its prepacked copy of the weights).", "", f"WikiText-103 base stand-in (random weights) int4 vs fp32 on the export-time stream: KL "
              f"{wr['kl_divergence']:.3g} nats per position, top-1 agreement {wr['top1_agreement']:.3f} (random "
              "weights give near-uniform distributions over 267,735 words, where top-1 is fragile; the accuracy "
              "that matters is the trained demo model's above)."]
    from txl_deploy.bench.op_profile import profile_table

    lines += ["", "Where a WikiText-103 base decode step goes (ONNX Runtime profiler, one thread, median of 5 steps; "
              "MatMulNBits are the 4-bit weight products, MatMul in the int4 graph the fp32 attention over the fp32 "
              "memory and the positional tables):", ""]
    for g in speed_wt["profiles"]:
        lines += [f"{g}:", "", "```", profile_table(speed_wt["profiles"][g], 8), "```", ""]
    graphs = {"fp32": wt["fp32"], "int4": wt["int4"], **{f"int4, block {b}": wt_other[b]["int4"] for b in others}}
    reads = {g: graph_step_bytes(path) for g, path in graphs.items()}
    lines += ["What a WikiText-103 base decode step reads (batch 1, memory full; counted from each graph: the "
              "weight products' constants with the scales as the fp32 the kernels get, the positional tables, "
              "the memory's keys and values). At batch 1 every byte is read once per step, so fp32's bytes over a "
              "graph's bound the speed-up a bandwidth-bound step could reach; a measured speed-up below that bound "
              "is time spent computing (the int8 products, quantizing activations per block) or between "
              "operators:", "",
              "| graph | weight products MB | positional tables MB | memory MB | total MB | bound on the speed-up "
              "| measured speed-up |",
              "|---|---|---|---|---|---|---|",
              *[f"| {g} | {r['weights'] / 1e6:.1f} | {r['positional_tables'] / 1e6:.1f} | {r['memory'] / 1e6:.1f} | "
                f"{r['total'] / 1e6:.1f} | {reads['fp32']['total'] / r['total']:.2f}x | "
                f"{speed_wt['median_ms']['fp32'] / speed_wt['median_ms'][g]:.2f}x |" for g, r in reads.items()], ""]
    lines += ["Each WikiText-103 base step against its own bytes (the bytes above; plain read: numpy's dot product, "
              "a pure read; copy floor: numpy copy, read + written; both of a 256 MB buffer, one thread, measured in "
              "the rounds of the steps: 9 rounds of 6 steps of each graph, then the probes; medians of each round's "
              "ratio):", "",
              "| graph | MB read / step | step ms | plain read ms | copy floor ms | step / read | step / copy |",
              "|---|---|---|---|---|---|---|",
              *[f"| {g} | {r['bytes'] / 1e6:.1f} | {r['step_ms']:.2f} | {r['read_ms']:.2f} | {r['copy_ms']:.2f} | "
                f"{r['over_read']:.2f}x | {r['over_copy']:.2f}x |" for g, r in own.items()], ""]
    text = "\n".join(lines).rstrip() + "\n"
    Path(args.out).write_text(text, encoding="utf-8")
    raw = {"against_own_bytes": own,
           "accuracy": acc["report"], "speed_wt103": speed_wt, "speed_demo": speed_demo, "step_bytes": reads,
           "wt103_stream": wt["report"]["stream"], "targets": [list(t) for t in targets], "command": command}
    Path(args.out).with_suffix(".json").write_text(json.dumps(raw, indent=2, default=str) + "\n", encoding="utf-8")
    print(text)
    for t, val, ok in targets:
        print(f"{'ok ' if ok else 'MISS'} {t}: {val}")


if __name__ == "__main__":
    main()
