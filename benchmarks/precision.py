"""Reduced-precision ONNX (fp16, int8, int8-dynamic) against fp32 on held-out text: the first half calibrates int8,
the second is evaluated. int8-dynamic's decode speed is a configuration of run_all.py."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime

from benchmarks import harness
from txl_deploy.assets import DEMO_DIR
from txl_deploy.checkpoints import load_model
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.exporters.precision.convert import reduce_onnx
from txl_deploy.exporters.precision.token_data import read_token_ids

# The accuracy targets (relative change in bits per character or perplexity against fp32) this benchmark checks.
TARGETS = {"fp16": 0.002, "int8": 0.02, "int8-dynamic": 0.01}

def accuracy(args, command):
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
             *harness.table(["precision", f"{metric} fp32", "reduced", "relative change", "top-1 agreement",
                             "max abs diff (stream)", "TensorRT-ready", "file MB"],
                            [[r["precision"], f"{r['fp32']:.4f}", f"{r['reduced']:.4f}",
                              f"{100 * r['relative_change']:+.3f}%", f"{r['top1_agreement']:.4f}",
                              f"{r['stream_max_abs_diff']:.3g}", "yes" if r["tensorrt_ready"] else "no",
                              f"{r['size_mb']:.1f}"] for r in rows])]
    met = {r["precision"]: abs(r["relative_change"]) <= TARGETS[r["precision"]] for r in rows if r["precision"] in TARGETS}
    lines += ["", "Targets (relative change in " + metric + " against fp32): "
              + ", ".join(f"{k} <= {100 * v:g}%" for k, v in TARGETS.items() if k in met) + ": "
              + ("all met" if all(met.values()) else "missed by " + ", ".join(k for k, ok in met.items() if not ok))
              + "."]
    gpu = "a GPU (not used)" if "CUDAExecutionProvider" in onnxruntime.get_available_providers() else "no GPU"
    body = "\n".join([f"Measured on {os.cpu_count()} CPU cores, {gpu}, onnxruntime {onnxruntime.__version__}.", "",
                      *lines])
    return harness.results_markdown("Reduced precision: accuracy on held-out text", body, command), rows, 0


def main(argv=None) -> int:
    p = harness.parser("precision", __doc__, md="results_precision.md", cache=False, threads=None)
    p.add_argument("--model", help="checkpoint [default: the demo model]")
    p.add_argument("--text", help="text file [default: the demo held-out text]")
    p.add_argument("--max-segment", type=int, default=128)
    p.add_argument("--out", help="folder for the models [default: a temporary folder]")
    return harness.main("precision", p, accuracy, argv)


if __name__ == "__main__":
    sys.exit(main())
