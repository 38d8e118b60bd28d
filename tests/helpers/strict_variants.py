"""Every exported variant of the tiny test model, and the strict checks each must pass.

Used by the graph checks' tests (built once per test session) and runnable on its own to print the table of results:

    python tests/helpers/strict_variants.py [WORK_DIR]

Variants: fp32, fp16, int8, int8-dynamic x `--state incremental|full` x every supported opset, plus each precision
and layout with its weights in an external data file (the >2 GB path, forced on the tiny model by lowering the
threshold). Checks: `onnx.checker.check_model(path, full_check=True)`, nodes in topological order (a Kahn sort
leaves the order unchanged), `polygraphy check lint` with no error, and (for reference) the TensorRT table.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

PRECISIONS = ("fp32", "fp16", "int8", "int8-dynamic")
STATES = ("incremental", "full")
DEFAULT_OPSET = 18


def opsets():
    from txl_deploy.exporters.onnx.export import SUPPORTED_OPSETS

    return list(SUPPORTED_OPSETS)


def variant_keys():
    """(precision, state, opset, external) of every variant."""
    keys = [(p, s, o, False) for o in opsets() for s in STATES for p in PRECISIONS]
    return keys + [(p, s, DEFAULT_OPSET, True) for s in STATES for p in PRECISIONS]


def variant_name(key) -> str:
    precision, state, opset, external = key
    return f"{precision}-{state}-opset{opset}{'-external' if external else ''}"


@contextlib.contextmanager
def external_data_threshold(n_bytes: int):
    """Lower the size from which exports keep their weights in an external data file."""
    from txl_deploy.exporters.onnx import writing

    old = writing.EXTERNAL_DATA_BYTES
    writing.EXTERNAL_DATA_BYTES = n_bytes
    try:
        yield
    finally:
        writing.EXTERNAL_DATA_BYTES = old


class Variants:
    """Builds each variant on first use (an fp32 export per state/opset/external, then its conversions)."""

    def __init__(self, ckpt, root: Path, prebuilt: dict | None = None):
        self.ckpt, self.root = ckpt, Path(root)
        self.paths = dict(prebuilt or {})
        self.calib = np.random.default_rng(2).integers(0, 60, size=300)

    def __getitem__(self, key) -> Path:
        if key not in self.paths:
            self.paths[key] = self._build(key)
        return self.paths[key]

    def _build(self, key) -> Path:
        from txl_deploy.exporters.onnx.export import export_onnx
        from txl_deploy.exporters.precision.convert import reduce_onnx

        precision, state, opset, external = key
        folder = self.root / variant_name(key)
        folder.mkdir(parents=True, exist_ok=True)
        out = folder / "model.onnx"
        if out.exists():  # a rerun of this script in the same folder
            return out
        with external_data_threshold(1) if external else contextlib.nullcontext():
            if precision == "fp32":
                export_onnx(self.ckpt, out, state=state, opset=opset, max_segment=16)
            else:
                fp32 = self[("fp32", state, opset, external)]
                reduce_onnx(fp32, out, precision=precision, calib=self.calib if precision == "int8" else None)
        return out


def check_file(path) -> dict:
    """full_check (onnx.checker on the path) and topological order, as independent of our own check as possible."""
    import onnx

    from txl_deploy.exporters.graph_checks import toposort

    result = {}
    try:
        onnx.checker.check_model(str(path), full_check=True)
        result["full_check"] = "pass"
    except Exception as e:  # noqa: BLE001 - reported in the table
        result["full_check"] = f"FAIL: {' '.join(str(e).split())[:200]}"
    graph = onnx.load(str(path), load_external_data=False).graph
    before = [n.SerializeToString() for n in graph.node]
    toposort(graph)
    result["toposort"] = "pass" if [n.SerializeToString() for n in graph.node] == before else "FAIL: out of order"
    return result


_LINT_ALL = """
import json, sys
from polygraphy.tools import main
out = {}
for model, report in zip(sys.argv[1::2], sys.argv[2::2]):
    out[model] = main(["check", "lint", model, "-o", report])
print("LINT-STATUS " + json.dumps(out))
"""


def polygraphy_lint(paths, work: Path, processes: int = 2) -> dict:
    """`polygraphy check lint` on each file: path -> {"status", "errors", "warnings"}.

    The `polygraphy` command's own entry point, called in `processes` worker processes that each lint a share of
    the files (one Python start-up per worker instead of one per file)."""
    work.mkdir(parents=True, exist_ok=True)
    reports = {str(p): work / f"lint-{i}.json" for i, p in enumerate(paths)}
    shares = [list(reports.items())[k::processes] for k in range(processes)]
    workers = [subprocess.Popen([sys.executable, "-c", _LINT_ALL, *[x for pair in share for x in map(str, pair)]],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for share in shares if share]
    status = {}
    for w in workers:
        out, err = w.communicate(timeout=1800)
        line = next((ln for ln in out.splitlines() if ln.startswith("LINT-STATUS ")), None)
        if line is None:
            raise RuntimeError(f"polygraphy check lint did not finish (rc {w.returncode}): {err[-2000:]}")
        status.update(json.loads(line[len("LINT-STATUS "):]))
    results = {}
    for p, report in reports.items():
        entries = json.loads(report.read_text())["lint_entries"] if report.exists() else []
        results[p] = {"status": status[p],
                      "errors": [e for e in entries if e["level"] == "exception"],
                      "warnings": [e for e in entries if e["level"] == "warning"]}
    return results


def table(variants: Variants, work: Path) -> str:
    keys = variant_keys()
    paths = [variants[k] for k in keys]
    lint = polygraphy_lint(paths, work / "lint")
    from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat

    rows = ["| variant | precision | state | opset | external data | full_check | toposort | polygraphy lint "
            "| TensorRT 10.x/11.x table |", "|---|---|---|---|---|---|---|---|---|"]
    for key, path in zip(keys, paths):
        checks = check_file(path)
        trt = check_tensorrt_compat(path)
        trt_text = "pass" if trt.ok else "refused: " + ", ".join(sorted({p.op or p.node for p in trt.problems}))
        lr = lint[str(path)]
        lint_text = "pass" if lr["status"] == 0 and not lr["errors"] else \
            f"FAIL: {'; '.join(e['message'][:120] for e in lr['errors']) or 'status ' + str(lr['status'])}"
        if lr["warnings"]:
            lint_text += f" ({len(lr['warnings'])} warning(s))"
        precision, state, opset, external = key
        rows.append(f"| {variant_name(key)} | {precision} | {state} | {opset} | {'yes' if external else 'no'} | "
                    f"{checks['full_check']} | {checks['toposort']} | {lint_text} | {trt_text} |")
    return "\n".join(rows)


def main(argv):
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, as pytest puts it
    from helpers.tiny import TINY_VOCAB, make_tiny_model
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    work = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="txl-strict-"))
    ckpt = work / "tiny"
    if not ckpt.exists():
        save_checkpoint(ckpt, make_tiny_model(), Vocab(TINY_VOCAB))
    print(table(Variants(ckpt, work / "variants"), work))


if __name__ == "__main__":
    main(sys.argv)
