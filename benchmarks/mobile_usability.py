"""ONNX Runtime's mobile-usability checker on the demo model's graphs: how much of each graph NNAPI and Core ML
would take, as exported and with a decode step's shapes fixed (`make_dynamic_shape_fixed`), and the ops each
lacks (quoted by docs/onnxruntime-mobile.md). The CPU provider runs every op; the checker does not look at
XNNPACK."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from txl_deploy.assets import DEMO_DIR
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.exporters.export import export_checkpoint

DEMO = DEMO_DIR / "kjv-char"
GRAPHS = {"fp32": {}, "fp32-full-state": {"state": "full"}, "int4": {"precision": "int4"},
          "int8-dynamic": {"precision": "int8-dynamic"}}
CHECKER = "onnxruntime.tools.check_onnx_model_mobile_usability"
COVERAGE = re.compile(r"(\d+) partitions with a total of (\d+)/(\d+) nodes can be handled by the (.+) EP")


def fix_shapes(src: Path, dst: Path, mem_len: int) -> None:
    """A decode step's shapes: batch 1, segment 1, one output position, the whole memory (mem_len slots)."""
    for name, value in {"batch": 1, "segment": 1, "positions": 1, "slots": mem_len}.items():
        subprocess.run([sys.executable, "-m", "onnxruntime.tools.make_dynamic_shape_fixed", "--dim_param", name,
                        "--dim_value", str(value), str(src), str(dst)], check=True, capture_output=True)
        src = dst


def check(path: Path) -> dict:
    """The checker's findings per provider: as exported, and as it predicts with fixed shapes."""
    done = subprocess.run([sys.executable, "-m", CHECKER, str(path)], check=True, capture_output=True, text=True)
    out, provider, fixed = {}, None, False
    for line in (done.stdout + done.stderr).splitlines():
        text = line.split("INFO:", 1)[-1].strip()
        if text.startswith("Checking ") and not text.startswith("Checking if") and "usability" not in text:
            provider, fixed = text[len("Checking "):], False
            out[provider] = {}
        elif text.startswith("Partition information if the model was updated"):
            fixed = True
        elif provider and (m := COVERAGE.match(text)):
            key = "fixed_shapes_predicted" if fixed else "as_exported"
            out[provider][key] = {"partitions": int(m[1]), "nodes": int(m[2]), "total_nodes": int(m[3])}
        elif provider and text.startswith("Unsupported ops:"):
            out[provider]["unsupported_ops"] = sorted(op.split(":")[-1] for op in text.split(":", 1)[1].split(","))
        elif text.startswith("For optimal performance the model should be used with"):
            out["recommendation"] = text
    return out


def measure(args, command):
    if args.report_only:
        results = json.loads(Path(args.md).with_suffix(".json").read_text())
        return report(results, results.get("command", command)), results, 0
    work = Path(args.work or tempfile.mkdtemp(prefix="mobile_usability."))
    work.mkdir(parents=True, exist_ok=True)
    results = {"model": "the bundled demo model (kjv-char)", "decode_shapes": "batch 1, segment 1, mem_len slots",
               "graphs": {}, "command": command}
    for name, options in GRAPHS.items():
        onnx_path = work / f"{name}.onnx"
        if not onnx_path.exists():
            export_checkpoint(DEMO, onnx_path, verify=False, **options)
        fixed = work / f"{name}.decode-shapes.onnx"
        fix_shapes(onnx_path, fixed, read_onnx_info(onnx_path).mem_len)
        results["graphs"][name] = {"as_exported": check(onnx_path), "fixed_decode_shapes": check(fixed)}
    return report(results, command), results, 0


def main(argv=None) -> int:
    p = harness.parser("mobile_usability", __doc__, md="results_mobile_usability.md", cache=False, threads=None)
    p.add_argument("--work", help="folder for the exported graphs [default: a temporary one]")
    p.add_argument("--report-only", action="store_true", help="measure nothing: rewrite the .md from the .json")
    return harness.main("mobile_usability", p, measure, argv)


def cov(d) -> str:
    """A coverage's cell: nodes taken, their share, partitions."""
    return f"{d['nodes']}/{d['total_nodes']} ({100 * d['nodes'] / d['total_nodes']:.0f}%), {d['partitions']}" if d else "-"


def report(results: dict, command: str) -> str:
    rows = []
    for name, graph in results["graphs"].items():
        fixed_graph = graph["fixed_decode_shapes"]
        rows += [[name, provider, cov(found.get("as_exported")), cov(found.get("fixed_shapes_predicted")),
                  cov(fixed_graph.get(provider, {}).get("as_exported")), ", ".join(found.get("unsupported_ops", []))]
                 for provider, found in graph["as_exported"].items() if provider != "recommendation"]
        rows.append([name, "recommendation", graph["as_exported"].get("recommendation", "-"), "",
                     fixed_graph.get("recommendation", "-"), ""])
    lines = ["The checker: onnxruntime.tools.check_onnx_model_mobile_usability; fixed shapes by "
             "onnxruntime.tools.make_dynamic_shape_fixed: " + results["decode_shapes"] + ".", "",
             *harness.table(["graph", "provider", "as exported (nodes, partitions)", "checker's fixed-shape prediction",
                             "decode shapes fixed, measured", "ops it lacks"], rows)]
    return harness.results_markdown("ONNX Runtime mobile-usability checker on the demo model's graphs",
                                    "\n".join(lines), command)


if __name__ == "__main__":
    sys.exit(main())
