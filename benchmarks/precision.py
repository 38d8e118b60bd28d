"""Reduced-precision ONNX: accuracy on held-out text and int8-dynamic CPU decode speed (benchmarks/RESULTS.md).

    # accuracy of fp16 / int8 / int8-dynamic against fp32 (default: the demo model and its held-out text;
    # the first half of the text calibrates int8, the second half is evaluated, so they never overlap)
    python benchmarks/precision.py accuracy [--model CKPT] [--text FILE] [--out DIR]

    # ONNX Runtime CPU decode time per token, fp32 vs int8-dynamic, on a published shape with random weights
    # (batch 1, memory full: mem_len tokens are fed before timing)
    python benchmarks/precision.py speed [--shape wt103-base] [--tokens 64] [--out DIR]

Prints a Markdown table and writes it with the raw numbers as JSON beside the models in --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def _quiet(*args, **kwargs):
    pass


def accuracy(args):
    from txl_deploy.checkpoints import load_model
    from txl_deploy.demo_assets import DEMO_DIR
    from txl_deploy.exporters.onnx import export_onnx
    from txl_deploy.exporters.precision import read_token_ids, reduce_onnx

    model = Path(args.model or DEMO_DIR / "kjv-char")
    text = Path(args.text or DEMO_DIR / "heldout.txt")
    out = Path(args.out or tempfile.mkdtemp(prefix="txl-precision-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(model)
    ids = read_token_ids(text, loaded.vocab, loaded.config.n_token, "text")
    half = ids.size // 2
    calib, heldout = ids[:half], ids[half:]
    fp32 = out / "fp32.onnx"
    export_onnx(loaded, fp32, max_segment=args.max_segment, force=True, log=print)
    rows = []
    for precision in ("fp16", "int8", "int8-dynamic"):
        t0 = time.perf_counter()
        res = reduce_onnx(fp32, out / f"{precision}.onnx", precision=precision, calib=calib, eval_data=heldout,
                          force=True, log=print)
        rep = res.info.export["precision_report"]
        acc = rep["accuracy"]
        rows.append({"precision": precision, "metric": acc["metric"], "fp32": acc["fp32"], "reduced": acc["reduced"],
                     "relative_change": acc["relative_change"], "top1_agreement": acc["top1_agreement"],
                     "stream_max_abs_diff": rep["stream"]["max_abs_diff"], "tensorrt_ready": rep["tensorrt_ready"],
                     "tokens": acc["tokens"], "size_mb": (out / f"{precision}.onnx").stat().st_size / 1e6,
                     "seconds": time.perf_counter() - t0})
    metric = rows[0]["metric"].replace("_", " ")
    lines = [f"Model `{model.name}`, {rows[0]['tokens']} held-out tokens of `{text.name}` (second half; the first "
             f"half calibrates int8), ONNX Runtime CPU, streaming evaluation with the memory.", "",
             f"| precision | {metric} fp32 | reduced | relative change | top-1 agreement | max abs diff (stream) "
             f"| TensorRT-ready | file MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['precision']} | {r['fp32']:.4f} | {r['reduced']:.4f} | {100 * r['relative_change']:+.3f}% "
                     f"| {r['top1_agreement']:.4f} | {r['stream_max_abs_diff']:.3g} | "
                     f"{'yes' if r['tensorrt_ready'] else 'no'} | {r['size_mb']:.1f} |")
    _emit(out / "precision_accuracy", lines, rows)


def speed(args):
    import torch

    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.config import published_config
    from txl_deploy.exporters.onnx import export_onnx
    from txl_deploy.exporters.precision import reduce_onnx
    from txl_deploy.model import MemTransformerLM
    from txl_deploy.runtimes import TxlRuntime

    out = Path(args.out or tempfile.mkdtemp(prefix="txl-precision-speed-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = published_config(args.shape)
    fp32, dyn = out / "fp32.onnx", out / "int8-dynamic.onnx"
    if not fp32.exists():
        torch.manual_seed(0)
        model = MemTransformerLM(cfg).eval()
        save_checkpoint(out / "ckpt", model, None, force=True)
        del model
        t0 = time.perf_counter()
        export_onnx(out / "ckpt", fp32, max_segment=args.max_segment, verify=False, force=True, log=print)
        print(f"fp32 export {time.perf_counter() - t0:.0f} s")
    if not dyn.exists():
        t0 = time.perf_counter()
        # random weights: the KL gate is for trained models, so the comparison is only recorded here
        reduce_onnx(fp32, dyn, precision="int8-dynamic", force=True, verify=False,
                    dynamic_per_channel=args.per_channel, log=print)
        print(f"int8-dynamic conversion {time.perf_counter() - t0:.0f} s")

    rng = np.random.default_rng(0)
    context = rng.integers(0, cfg.n_token, size=(1, cfg.mem_len))
    decode = rng.integers(0, cfg.n_token, size=args.tokens)
    times = {}
    runtimes = {"fp32": TxlRuntime.load(fp32, providers=["cpu"]), "int8-dynamic": TxlRuntime.load(dyn, providers=["cpu"])}
    for rt in runtimes.values():
        rt.prefill(context)  # memory full: every decode step attends to mem_len cached tokens
        rt.step([[int(decode[0])]])  # warm-up
    for name in runtimes:
        times[name] = []
    for tok in decode:  # interleaved, so a neighbour's load on the machine hits both alike
        for name, rt in runtimes.items():
            t0 = time.perf_counter()
            rt.step([[int(tok)]])
            times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    sizes = {k: p.stat().st_size / 1e6 for k, p in (("fp32", fp32), ("int8-dynamic", dyn))}
    import os

    lines = [f"`{args.shape}` shape, random weights, batch 1, memory full ({cfg.mem_len} tokens), ONNX Runtime "
             f"CPU provider, {os.cpu_count()} cores, median of {args.tokens} decode steps (interleaved).", "",
             "| graph | ms / token | speed-up | file MB |", "|---|---|---|---|"]
    for k in ("fp32", "int8-dynamic"):
        lines.append(f"| {k} | {1000 * med[k]:.2f} | {med['fp32'] / med[k]:.2f}x | {sizes[k]:.0f} |")
    _emit(out / "precision_speed", lines, {"median_s": med, "times_s": times, "size_mb": sizes,
                                            "speedup": med["fp32"] / med["int8-dynamic"]})


def _emit(stem: Path, lines, raw):
    table = "\n".join(lines)
    print(table)
    stem.with_suffix(".md").write_text(table + "\n")
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=2))
    print(f"wrote {stem}.md and {stem}.json")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy", help="fp16/int8/int8-dynamic vs fp32 on held-out text")
    a.add_argument("--model", help="checkpoint [default: the demo model]")
    a.add_argument("--text", help="text file [default: the demo held-out text]")
    a.add_argument("--max-segment", type=int, default=128)
    a.add_argument("--out", help="folder for the models and the table [default: a temporary folder]")
    s = sub.add_parser("speed", help="int8-dynamic vs fp32 ONNX Runtime CPU decode time per token")
    s.add_argument("--shape", default="wt103-base")
    s.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    s.add_argument("--max-segment", type=int, default=64)
    s.add_argument("--per-channel", action="store_true", help="per-channel int8 weights in the dynamic graph")
    s.add_argument("--out", help="folder for the models (reused when present) and the table")
    args = p.parse_args()
    accuracy(args) if args.cmd == "accuracy" else speed(args)


if __name__ == "__main__":
    main()
