"""Reduced-precision ONNX: accuracy on held-out text (benchmarks/results_precision.md, included in RESULTS.md).

    # accuracy of fp16 / int8 / int8-dynamic against fp32 (default: the demo model and its held-out text;
    # the first half of the text calibrates int8, the second half is evaluated, so they never overlap)
    python benchmarks/precision.py accuracy [--model CKPT] [--text FILE] [--out DIR] [--md FILE [--force]]

Prints a Markdown table and writes it with the raw numbers as JSON beside the models in --out; --md writes it as
a results file that names this command (benchmarks/run_all.py includes benchmarks/results_*.md in RESULTS.md).
The decode speed of int8-dynamic against fp32 is measured by benchmarks/run_all.py (configuration
wt103-base-int8-dynamic), at the same thread setting as every other row there.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

# The accuracy targets (relative change in bits per character or perplexity against fp32) this benchmark checks.
TARGETS = {"fp16": 0.002, "int8": 0.02, "int8-dynamic": 0.01}



def accuracy(args):
    from txl_deploy.assets import DEMO_DIR
    from txl_deploy.checkpoints import load_model
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.exporters.precision.convert import reduce_onnx
    from txl_deploy.exporters.precision.token_data import read_token_ids

    model = Path(args.model or DEMO_DIR / "kjv-char")
    text = Path(args.text or DEMO_DIR / "heldout.txt")
    out = Path(args.out or tempfile.mkdtemp(prefix="txl-precision-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(model)
    ids = read_token_ids(text, loaded.vocab, loaded.config.n_token, "text")
    half = ids.size // 2
    calib, heldout = ids[:half], ids[half:]
    fp32 = out / "fp32.onnx"
    export_onnx(loaded, fp32, max_segment=args.max_segment, force=True)
    rows = []
    for precision in ("fp16", "int8", "int8-dynamic"):
        t0 = time.perf_counter()
        res = reduce_onnx(fp32, out / f"{precision}.onnx", precision=precision, calib=calib, eval_data=heldout,
                          force=True)
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
    met = {r["precision"]: abs(r["relative_change"]) <= TARGETS[r["precision"]] for r in rows if r["precision"] in TARGETS}
    lines += ["", "Targets (relative change in " + metric + " against fp32): "
              + ", ".join(f"{k} <= {100 * v:g}%" for k, v in TARGETS.items() if k in met) + ": "
              + ("all met" if all(met.values()) else "missed by " + ", ".join(k for k, ok in met.items() if not ok))
              + "."]
    _emit(out / "precision_accuracy", lines, rows)
    if args.md:
        import onnxruntime

        from txl_deploy.bench.report import command_line, results_markdown, write_text

        gpu = "a GPU (not used)" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "no GPU"
        body = "\n".join([f"Measured on {os.cpu_count()} CPU cores, {gpu}, onnxruntime {onnxruntime.__version__}.",
                           "", *lines])
        write_text(args.md, results_markdown("Reduced precision: accuracy on held-out text", body,
                                             command_line("benchmarks/precision.py", sys.argv[1:])), args.force)
        print(f"wrote {args.md}")


def _emit(stem: Path, lines, raw):
    table = "\n".join(lines)
    print(table)
    stem.with_suffix(".md").write_text(table + "\n")
    stem.with_suffix(".json").write_text(json.dumps(raw, indent=2))
    print(f"wrote {stem}.md and {stem}.json")




def main():
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("accuracy", help="fp16/int8/int8-dynamic vs fp32 on held-out text")
    a.add_argument("--model", help="checkpoint [default: the demo model]")
    a.add_argument("--text", help="text file [default: the demo held-out text]")
    a.add_argument("--max-segment", type=int, default=128)
    a.add_argument("--out", help="folder for the models and the table [default: a temporary folder]")
    a.add_argument("--md", help="also write the table as a results file naming this command, e.g. "
                                "benchmarks/results_precision.md")
    a.add_argument("--force", action="store_true", help="overwrite an existing --md file")
    args = p.parse_args()
    if args.md and Path(args.md).exists() and not args.force:  # refuse before minutes of measuring, not after
        raise SystemExit(f"{args.md} already exists (use --force to overwrite)")
    accuracy(args)


if __name__ == "__main__":
    main()
