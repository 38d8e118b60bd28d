"""Peers side by side: decode latency of the same model in ONNX Runtime through txl-deploy, OpenVINO, HuggingFace
transformers' TransfoXL, PyTorch eager and torch.compile, interleaved in one run, each side's log-probs against
eager's. What each side runs: docs/benchmarks.md ("Peers")."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from tqdm import tqdm

from benchmarks import harness
from benchmarks.peer_compile import TorchCompileBackend
from benchmarks.peer_huggingface import HuggingFaceBackend
from benchmarks.peer_openvino import OpenVinoBackend, cpu_default_precision
from txl_deploy.bench import timing
from txl_deploy.bench.benchmark import report_header, versions_text
from txl_deploy.bench.eager_baseline import EagerAtPositions
from txl_deploy.bench.random_weights import standin_onnx
from txl_deploy.bench.runners import torch_threads
from txl_deploy.checkpoints import load_model
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend

logger = logging.getLogger(__name__)

SCHEMA = "txl-deploy-peers/1"
PEERS = ("onnxruntime", "openvino-f32", "openvino-default", "transformers", "eager", "torch-compile")
LABELS = {"onnxruntime": "onnxruntime (txl-deploy)", "openvino-f32": "openvino (f32 hint)",
          "openvino-default": "openvino (default precision)", "transformers": "transformers TransfoXL (mems)",
          "eager": "torch (eager)", "torch-compile": "torch.compile (cached step)"}
REFERENCE, BASELINE = "onnxruntime", "eager"
_OV_TYPE_NAMES = {"fp32": "f32", "fp16": "f16"}  # a graph's precision (`Backend.precision`) in OpenVINO's names


def computed_precision(backend) -> str:
    """The precision a side's arithmetic ran in, in OpenVINO's names (f32, bf16, f16): what the OpenVINO plugin
    reports it compiled the model for, else the precision of the model or graph the backend runs."""
    reported = getattr(backend, "inference_precision", None)
    return reported or _OV_TYPE_NAMES.get(backend.precision, backend.precision)


def row_label(peer: str, precision: str) -> str:
    """A side's name in the results: its label, and the precision it computed in where that was not f32 (the
    tables' "fp32 unless said")."""
    return LABELS[peer] if precision == "f32" else f"{LABELS[peer]}, computed in {precision}"


def _recording(peer: str, open_fn, precisions: dict):
    def open_side():
        rt = open_fn()
        precisions[peer] = computed_precision(rt.backend)
        return rt
    return open_side


def openers(checkpoint, onnx_path, mem_len: int, threads, peers) -> dict:
    """peer name -> () -> TxlRuntime, for the peers asked for."""
    table = {
        "onnxruntime": lambda: TxlRuntime(OrtBackend(onnx_path, providers=["cpu"], intra_op_threads=threads)),
        "openvino-f32": lambda: TxlRuntime(OpenVinoBackend(onnx_path, "f32", threads)),
        "openvino-default": lambda: TxlRuntime(OpenVinoBackend(onnx_path, None, threads)),
        "transformers": lambda: TxlRuntime(HuggingFaceBackend.from_checkpoint(checkpoint, mem_len=mem_len, threads=threads)),
        "eager": lambda: TxlRuntime(EagerAtPositions.from_checkpoint(checkpoint, mem_len=mem_len)),
        "torch-compile": lambda: TxlRuntime(TorchCompileBackend.from_checkpoint(checkpoint, mem_len=mem_len)),
    }
    return {p: table[p] for p in peers}


def run_peers(model: str, mem_len: int | None = None, batches=(1, 8), gen_len: int = 24, repeat: int = 3,
              warmup: int = 2, threads: int | None = 1, cache_dir=None, peers=PEERS, seed: int = 0,
              name: str | None = None, progress: bool = True) -> dict:
    """Every peer in `peers` (names of `PEERS`; onnxruntime and eager always run, as the references) on `model`;
    returns the JSON report (`SCHEMA`)."""
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        raise InputError(f"unknown peers {', '.join(unknown)}; known: {', '.join(PEERS)}")
    if gen_len < 1 or repeat < 1 or warmup < 0 or not batches or min(batches) < 1:
        raise InputError("gen-len, repeat and batch sizes must be >= 1, warmup >= 0")
    checkpoint, source = harness.checkpoint_of(model, cache_dir)
    config = load_model(checkpoint).config
    mem_len = int(mem_len or config.mem_len)
    if mem_len < 1:
        raise InputError(f"{model}: the model has no memory length; pass one")
    default_precision = cpu_default_precision() if "openvino-default" in peers else None
    chosen = [p for p in PEERS if p in set(peers) | {REFERENCE, BASELINE}]
    notes = []
    if default_precision == "f32" and "openvino-f32" in chosen:
        chosen.remove("openvino-default")
        notes.append("OpenVINO's CPU plugin defaults to f32 on this CPU (no AVX512-BF16 or AMX): its default is the "
                     "f32-hint row, measured once")
    torch_threads(threads)
    onnx_path = standin_onnx(checkpoint, cache_dir, mem_len)  # exported before anything is timed
    open_fns = openers(checkpoint, onnx_path, mem_len, threads, chosen)
    results = []
    bar = tqdm(total=len(batches) * len(chosen) * (repeat + 1), desc="peers", unit="phase", disable=not progress,
               leave=False)
    for batch in batches:
        bar.set_postfix_str(f"mem_len {mem_len} batch {batch}")
        precisions = {}  # noted while each side is open: the precision its arithmetic ran in
        sides = [timing.Side(p, _recording(p, open_fns[p], precisions), decode_only=True) for p in chosen]
        stream = timing.make_stream(config.n_token, batch, mem_len, gen_len, 1, seed)
        timing.run_pair(sides, stream, repeat, warmup, progress=bar.update)
        by = {s.label: s for s in sides}
        summary = {p: {"backend": row_label(p, precisions[p]), "precision": precisions[p],
                       **timing.summarise(by[p], stream), "decode_rounds_ms": timing.decode_rounds_ms(by[p], repeat)}
                   for p in chosen}
        ref, base = summary[REFERENCE]["decode_ms"]["p50"], summary[BASELINE]["decode_ms"]["p50"]
        results.append({
            "mem_len": mem_len, "batch": batch, "sides": summary,
            "relative_to_onnxruntime": {p: ref / s["decode_ms"]["p50"] for p, s in summary.items()},
            "relative_to_eager": {p: base / s["decode_ms"]["p50"] for p, s in summary.items()},
            "parity_vs_eager": {p: timing.parity(by[p], by[BASELINE]) for p in chosen if p != BASELINE},
        })
    bar.close()
    return {
        **report_header(SCHEMA, openvino=harness.package_version("openvino"),
                        transformers=harness.package_version("transformers")),
        "name": name or (model if source == "shape" else Path(model).name), "model": str(model), "source": source,
        "settings": {"mem_len": mem_len, "batches": list(batches), "gen_len": gen_len, "repeat": repeat,
                     "warmup": warmup, "threads": threads, "seed": seed, "peers": chosen},
        "openvino": {"cpu_default_precision": default_precision}, "notes": notes,
        "config": config.to_dict(), "results": results,
    }


def faster_than_reference(reports) -> list[tuple[str, int, str, float]]:
    """(model, batch, peer label, how many times faster) for every row where a peer beat ONNX Runtime's median."""
    out = []
    for rep in reports:
        for res in rep["results"]:
            for p, x in res["relative_to_onnxruntime"].items():
                if p != REFERENCE and x > 1:
                    out.append((rep["name"], res["batch"], res["sides"][p]["backend"], x))
    return out


def _ms(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def section(rep: dict) -> str:
    s, c, results = rep["settings"], rep["config"], rep["results"]
    batches = [res["batch"] for res in results]

    def parity(p, key, best) -> str:
        par = [res["parity_vs_eager"].get(p) for res in results]
        return "-" if None in par else f"{best(q[key] for q in par):{'.4f' if key == 'top1_agreement' else '.1e'}}"

    return "\n".join([
        f"## {rep['name']}", "",
        f"Model: {rep['name']} ({'random weights' if rep['source'] == 'shape' else 'checkpoint'}; "
        f"{c['n_layer']} layers, d_model {c['d_model']}, {c['n_token']:,} tokens), mem_len {s['mem_len']}, memory "
        f"full, {s['gen_len']} decode steps x {s['repeat']} rounds per side (after {s['warmup']} warm-up "
        f"steps), {s['threads'] or 'library default'} thread(s) per side, fp32 unless said; measured {rep['date']}.",
        "",
        *harness.table(["side", *(f"batch {b}: {what}" for what in ("ms/step (p50)", "vs ONNX Runtime", "vs eager")
                                  for b in batches), "max abs diff vs eager", "KL vs eager", "top-1 vs eager"],
                       [[results[0]["sides"][p]["backend"], *(_ms(res["sides"][p]["decode_ms"]["p50"]) for res in results),
                         *(f"{res['relative_to_onnxruntime'][p]:.2f}x" for res in results),
                         *(f"{res['relative_to_eager'][p]:.1f}x" for res in results),
                         parity(p, "max_abs_diff", max), parity(p, "kl_divergence", max),
                         parity(p, "top1_agreement", min)] for p in s["peers"]], numeric_from=1),
        "", *[f"- {n}" for n in rep["notes"]]]).rstrip() + "\n"


HOW_TO_READ = """\
`vs ONNX Runtime` = ONNX Runtime's median step / the side's (above 1x the side is faster); `vs eager` likewise
against the model as trained; the last three columns compare each side's log-probs with eager's on every timed step
of the first round. What each side runs and how the rounds alternate: docs/benchmarks.md ("Peers")."""


def results_file(reports: list[dict], command: str) -> str:
    first = reports[0]
    m, v = first["machine"], first["versions"]
    faster = faster_than_reference(reports)
    if faster:
        verdict = ["Rows where a peer's median step beat ONNX Runtime through txl-deploy:", "",
                   *[f"- {name}, batch {b}: {label}, {x:.2f}x" for name, b, label, x in faster]]
    else:
        verdict = ["No peer's median step beat ONNX Runtime through txl-deploy on any row."]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}. Versions: "
        f"{versions_text(v, ('python', 'onnxruntime', 'openvino', 'torch', 'transformers', 'numpy', 'txl_deploy'))}. "
        "OpenVINO CPU default precision here: "
        f"{next((r['openvino']['cpu_default_precision'] for r in reports if r['openvino']['cpu_default_precision']), 'not asked')}.",
        "",
        *verdict,
        "",
        HOW_TO_READ,
        "",
    ]
    for rep in reports:
        lines += [section(rep), ""]
    return harness.results_markdown("Peers: the same model in other engines", "\n".join(lines), command)



DEFAULT_MODELS = ("enwik8-base", "wt103-base", "txl_deploy/assets/demo/kjv-char")
NAMES = {"txl_deploy/assets/demo/kjv-char": "kjv-char-demo"}


def measure(args, command):
    models = args.model or list(DEFAULT_MODELS)
    if args.mem_len and len(args.mem_len) != len(models):
        raise InputError(f"--mem-len has {len(args.mem_len)} values for {len(models)} models")
    reports = [run_peers(str(harness.ROOT / m) if (harness.ROOT / m).exists() else m, mem_len, args.batch,
                         args.gen_len, args.repeat, args.warmup, args.threads or None, args.cache_dir,
                         [s for s in args.peers.split(",") if s], name=NAMES.get(m))
               for m, mem_len in zip(models, args.mem_len or [None] * len(models))]
    for name, batch, label, x in faster_than_reference(reports):
        logger.info(f"FASTER than ONNX Runtime: {name} batch {batch}: {label} {x:.2f}x")
    return results_file(reports, command), {"command": command, "reports": reports}, 0


def main(argv=None) -> int:
    p = harness.parser("peers", __doc__, md="results_peers.md")
    p.add_argument("--model", action="append", help=f"a shape name or a checkpoint, repeatable (default: "
                   f"{', '.join(DEFAULT_MODELS)})")
    p.add_argument("--mem-len", type=harness.int_list, help="memory lengths, one per --model (default: their own)")
    p.add_argument("--batch", type=harness.int_list, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--gen-len", type=int, default=24, help="decode steps timed per side and round (default 24)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per side first (default 2)")
    p.add_argument("--peers", default=",".join(PEERS), help="comma-separated (default all); onnxruntime and eager "
                   "always run")
    return harness.main("peers", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
