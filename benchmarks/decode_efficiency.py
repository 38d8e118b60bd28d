"""How close a batch-1 decode step comes to reading its bytes, on every published shape in one run, against the
plain read and the copy of those bytes round by round; where a shape misses (and on WikiText-103 base always),
ONNX Runtime's profile per op and session options compared. Method: docs/benchmarks.md ("Decode efficiency")."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from benchmarks import harness
from benchmarks.int4 import int4_graph, open_runtime
from benchmarks.step_bytes import (
    EFFICIENCY_HEAD,
    EVICT_BYTES,
    efficiency_cells,
    graph_step_bytes,
    interleaved_efficiency,
    matmul_alone,
    profile_nodes,
)
from txl_deploy.bench.bandwidth_floor import BandwidthProbe, decode_bytes
from txl_deploy.bench.random_weights import shape_config, standin_checkpoint, standin_onnx
from txl_deploy.contract import io_spec
from txl_deploy.exporters.precision.int4 import INT4_DEFAULT_BLOCK
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

SHAPES = {"enwik8-base": "enwik8 base", "text8": "text8", "wt103-base": "WikiText-103 base",
          "wt103-large": "WikiText-103 large", "lm1b-large": "One Billion Word"}
TARGET = 1.5  # step / plain read of its bytes
ALWAYS_PROFILED = "wt103-base"
BIG_MATMUL_BYTES = 1_000_000  # a MatMul whose inputs are over this is listed by name


def open_shape(name: str, work: Path, threads: int, seed: int = 0):
    """(graph path, runtime, a callable running one decode step with the memory full)."""
    path = standin_onnx(standin_checkpoint(name, work), work, shape_config(name).mem_len, max_segment=64)
    rt = TxlRuntime(OrtBackend(path, providers=["cpu"], intra_op_threads=threads))
    return path, rt, harness.decode_step(rt, np.random.default_rng(seed))


def profile(path, rt, threads: int) -> dict:
    """Per op kind and per big MatMul from the profiler, with the big MatMuls run alone beside."""
    state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
    tokens = np.random.default_rng(1).integers(0, rt.n_token, size=(1, 7))
    prof = profile_nodes(path, state, tokens, threads=threads, steps=5)
    big = [n for n in prof["nodes"] if n["op_type"] in ("MatMul", "Gemm", "FusedGemm", "FusedMatMul")
           and n["bytes"] >= BIG_MATMUL_BYTES]
    alone = matmul_alone(path, [n["name"] for n in big], threads=threads)
    for n in big:
        n["alone_ms"] = alone.get(n["name"], {}).get("ms")
    prof["big_matmuls"] = big
    return prof


def option_sides(path, rt) -> dict:
    """{label: (what it does, a callable running one decode step)}: sessions of the graph at `path` from the memory
    `rt` holds (kept fixed: every side reads the same full memory), one intra-op thread each."""
    state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
    outputs = rt.backend.output_names
    rng = np.random.default_rng(2)

    def plain(config: dict, basic: bool = False):
        return harness.ort_session(path, 1, arena=False, basic=basic, config=config)

    def run_step(session):
        def step():
            feeds = {**state, io_spec.TOKENS: rng.integers(0, rt.n_token, size=(1, 1)),
                     io_spec.OUT_POSITIONS: np.zeros((1, 1), np.int64)}
            session.run(outputs, feeds)
        return step

    ours, ours_state = rt.backend, rt.backend.state_from_arrays(state, copy=True)
    return {
        "defaults": ("a plain session: ONNX Runtime's defaults (prepacked weights), no CPU arena, run()",
                     run_step(plain({}))),
        "no prepacking": ("the same with session.disable_prepacking = 1, run()",
                          run_step(plain({"session.disable_prepacking": "1"}))),
        "basic optimisations": ("no prepacking, graph optimisation level BASIC instead of ALL, run()",
                                run_step(plain({"session.disable_prepacking": "1"}, basic=True))),
        "txl-deploy backend": ("OrtBackend.run as TxlRuntime calls it: no prepacking, weights from the shared pool, "
                               "the segment's keys and values written into the ring",
                               lambda: ours.run(ours_state, rng.integers(0, rt.n_token, size=(1, 1)),
                                                np.zeros((1, 1), np.int64))),
    }


def options_table(label: str, sides: dict, results: dict) -> list[str]:
    lines = [f"### {label}: session options and ways of calling it", ""]
    rows = [[name, what, *(f"{results[name][k]:.2f}" for k in ("step_ms", "step_cpu_ms")),
             *(f"{results[name][k]:.2f}x" for k in ("over_read_cpu", "over_copy_cpu"))]
            for name, (what, _) in sides.items()]
    return lines + harness.table(["side", "what it does", "step ms", "step CPU ms", "step / read (CPU time)",
                                  "step / copy (CPU time)"], rows) + [""]


def op_tables(label: str, prof: dict) -> list[str]:
    lines = [f"### {label}: where a decode step goes", "",
             f"One step: {prof['step_ms']:.2f} ms in the session, {prof['step_cpu_ms']:.2f} ms of CPU time on its thread, "
             f"{prof['kernel_ms']:.2f} ms in kernels (ONNX Runtime profiler, one thread, median of 5 steps per node; "
             "bytes: every input a kernel reads per step).", "",
             *harness.table(["op kind", "nodes", "ms / step", "MB read / step", "GB/s"],
                            [[o["op_type"], o["nodes"], f"{o['ms_per_step']:.3f}", f"{o['bytes'] / 1e6:.2f}",
                              f"{o['gb_per_s']:.1f}"] for o in prof["ops"] if o["ms_per_step"] >= 0.005])]
    return lines + [
        "", f"Each weight product reading over {BIG_MATMUL_BYTES / 1e6:.0f} MB, in the graph and alone (a one-node "
        f"model, each run after a read of {EVICT_BYTES // 2**20} MB):", "",
        *harness.table(["product", "MB read", "in graph ms", "GB/s", "alone ms", "GB/s", "graph / alone"],
                       [[f"`{n['name']}`", f"{n['bytes'] / 1e6:.2f}", f"{n['ms_per_step']:.3f}",
                         f"{n['bytes'] / max(n['ms_per_step'], 1e-9) / 1e6:.1f}",
                         *((f"{a:.3f}", f"{n['bytes'] / a / 1e6:.1f}", f"{n['ms_per_step'] / a:.2f}") if a else
                           ("B is not a constant (the memory, or a table)", "", ""))]
                        for n in prof["big_matmuls"] for a in [n.get("alone_ms")]]), ""]


def efficiency_rows(shapes: list, results: dict, skipped: dict) -> list[str]:
    rows = []
    for name in shapes:
        shape, _, graph = name.partition(" ")  # "wt103-base int4, prepacked": a shape's int4 graph
        label, mem_len = f"{SHAPES.get(shape, shape)} {graph}".strip(), shape_config(shape).mem_len
        if name in skipped:
            rows.append([label, mem_len, *[""] * len(EFFICIENCY_HEAD), f"not measured: {skipped[name]}"])
        else:
            r = results[name]
            rows.append([label, mem_len, *efficiency_cells(r), "yes" if r["over_read_cpu"] <= TARGET else "NO"])
    return harness.table(["shape", "mem_len", *EFFICIENCY_HEAD, "within 1.5x read (CPU time)"], rows)


def measure(args, command):
    work = Path(args.cache_dir)
    work.mkdir(parents=True, exist_ok=True)
    shapes = [s for s in args.shapes.split(",") if s]
    load_start = harness.load_average()
    skipped, opened = {}, {}
    for name in shapes:
        gb = decode_bytes(shape_config(name), shape_config(name).mem_len, 1)["weight_bytes"] / 1e9
        if gb > args.max_weights_gb:
            skipped[name] = (f"{gb:.1f} GB of fp32 weights, above --max-weights-gb {args.max_weights_gb:g}: its "
                             "export (external data) and a session holding it are not run on this shared 24 GB "
                             "machine")
            continue
        opened[name] = open_shape(name, work, args.threads)
    for name in [s for s in args.int4.split(",") if s in opened]:  # its int4 graph, as int4.py opens it
        path = int4_graph(opened[name][0], INT4_DEFAULT_BLOCK, verify=False)[0]
        for label, prepack in ((f"{name} int4", False), (f"{name} int4, prepacked", True)):
            rt = open_runtime(path, args.threads, prepack)
            opened[label] = (path, rt, harness.decode_step(rt, np.random.default_rng(0)))
    probe = BandwidthProbe()
    n_bytes = {name: graph_step_bytes(path)["total"] for name, (path, _, _) in opened.items()}
    results = interleaved_efficiency({name: step for name, (_, _, step) in opened.items()}, n_bytes, probe,
                                     args.rounds, args.steps_per_round)
    options, option_results = {}, {}
    if ALWAYS_PROFILED in opened and not args.no_options:
        path, rt, _ = opened[ALWAYS_PROFILED]
        options = option_sides(path, rt)
        option_results = interleaved_efficiency({name: step for name, (_, step) in options.items()},
                                                {name: n_bytes[ALWAYS_PROFILED] for name in options}, probe,
                                                args.rounds, args.steps_per_round)
        options = {name: (what, None) for name, (what, _) in options.items()}  # the sessions go
    profiles = {name: profile(path, rt, args.threads) for name, (path, rt, _) in opened.items()
                if name == ALWAYS_PROFILED or (name in shapes and results[name]["over_read"] > TARGET)}
    for _, rt, _ in opened.values():
        rt.close()
    load_end = harness.load_average()
    lines = [
        *harness.machine_lines(load_start, load_end),
        f"- each shape: random-weight stand-in, ONNX fp32, ONNX Runtime CPU, {args.threads} intra-op thread, batch 1, "
        "memory full at the shape's evaluation mem_len",
        f"- {args.rounds} rounds of {args.steps_per_round} decode steps of every shape, then a plain read and a copy "
        "of a 256 MB buffer; each round's step median against that round's bandwidth, medians over rounds; bytes a "
        "step reads counted from the graph; CPU time on the calling thread's clock (see docs/benchmarks.md)",
        "",
        f"## Every shape (target: step within {TARGET}x the plain read of its bytes)",
        "",
        *efficiency_rows([*shapes, *(n for n in opened if n not in shapes)], results, skipped),
        "",
    ]
    if options:
        lines += options_table(SHAPES[ALWAYS_PROFILED], options, option_results)
    for name, prof in profiles.items():
        lines += op_tables(SHAPES.get(name, name), prof)
    text = harness.results_markdown("Decode efficiency: each published shape's step against the bytes it reads",
                                    "\n".join(lines), command)
    raw = {"command": command, "load_start": load_start, "load_end": load_end, "results": results,
           "skipped": skipped, "profiles": profiles,
           "options": {name: {"what": what, **option_results[name]} for name, (what, _) in options.items()},
           "target": TARGET}
    return text, raw, 0


def main(argv=None) -> int:
    p = harness.parser("decode_efficiency", __doc__, md="results_efficiency.md")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated (default {','.join(SHAPES)})")
    p.add_argument("--rounds", type=int, default=9, help="rounds of steps and probes")
    p.add_argument("--steps-per-round", type=int, default=6, help="decode steps per shape per round")
    p.add_argument("--max-weights-gb", type=float, default=2.0, help="shapes with more fp32 weights are not run")
    p.add_argument("--no-options", action="store_true",
                   help=f"skip the session options compared on {SHAPES[ALWAYS_PROFILED]}")
    p.add_argument("--int4", default=ALWAYS_PROFILED, help="shapes whose int4 graph is measured too, unpacked and "
                   f"prepacked, comma-separated (default {ALWAYS_PROFILED}; '' for none)")
    return harness.main("decode_efficiency", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
