"""Imports sit at the top of modules, so the graph import-linter checks is the real one. A function-level import is
allowed only for what the base install lacks (the optional dependencies below) or for the project's PyTorch model
(`txl_deploy.model`, which imports torch), and it says why in a comment. `import txl_deploy`, the command line and
the ONNX Runtime and TensorRT backends never import torch: edge devices run them with numpy alone."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("txl_deploy", "exporters", "runtimes")
# Imported where they are used, because a base install (numpy, onnx, click, tqdm) does not have them.
# openvino: a peer the benchmarks compare with (benchmarks/peer_openvino.py), from the test extra.
# sacremoses: the `text` extra (word vocabularies read with the Moses tokenizers); huggingface_hub: the `hub` extra.
# executorch, torchao: the `executorch` extra (ExecuTorch programs and their quantization); mido: the `music` extra.
OPTIONAL = {"mido", "torch", "tensorrt", "cuda", "onnxruntime", "transformers", "tritonclient", "safetensors", "onnxscript",
            "matplotlib", "threadpoolctl", "openvino", "sacremoses", "huggingface_hub", "executorch", "torchao"}
TORCH_MODULES = "txl_deploy.model"
# The HTTP server imports its extra (FastAPI, uvicorn, sse-starlette, prometheus-client) at the top of its modules;
# the `serve` command imports it when it runs, so the command line works on a base install.
SERVE_MODULES = "txl_deploy.serving.http"


def _late_imports():
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().split("\n")
            tree = ast.parse("\n".join(lines))
            top = set(tree.body)
            for node in ast.walk(tree):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and node not in top:
                    module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    commented = "#" in lines[node.end_lineno - 1] or lines[node.lineno - 2].strip().startswith("#")
                    yield path.relative_to(ROOT), node.lineno, module, commented


def test_the_optional_list_holds_no_base_dependency():
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[ ]", d)[0].lower() for d in base}
    assert names and not names & OPTIONAL


def test_function_level_imports_are_optional_and_say_why():
    wrong = [f"{path}:{line}: {module}" for path, line, module, _ in _late_imports()
             if module.split(".")[0] not in OPTIONAL and not any(module == m or module.startswith(m + ".")
                                                                 for m in (TORCH_MODULES, SERVE_MODULES))]
    assert not wrong, "function-level imports of modules every install has; move them to the top:\n" + "\n".join(wrong)
    silent = [f"{path}:{line}: {module}" for path, line, module, commented in _late_imports() if not commented]
    assert not silent, "function-level imports without a comment saying why:\n" + "\n".join(silent)


def test_the_base_install_paths_import_no_torch():
    code = ("import sys, txl_deploy, txl_deploy.cli, txl_deploy.runtimes.backends.onnxruntime, "
            "txl_deploy.runtimes.backends.tensorrt, txl_deploy.serving.triton.client, txl_deploy.exporters.web.site; "
            "heavy = sorted(m for m in ('torch', 'tensorrt', 'onnxruntime', 'transformers', 'tritonclient', "
            "'fastapi', 'uvicorn', 'sse_starlette', 'prometheus_client') "
            "if m in sys.modules); print(heavy); sys.exit(1 if heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
