"""The layering rule of ARCHITECTURE.md, enforced: import-linter's contracts in pyproject.toml, run over the package.

import-linter (through grimp) finds a package's modules by walking its folder, and `txl_deploy.exporters` and
`txl_deploy.runtimes` live in the checkout's top-level `exporters/` and `runtimes/` (pyproject's package-dir maps
them). So the contracts run over a copy of the sources laid out as an install lays them out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]



def _installed_layout(dest: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "demo", "static")  # code only
    shutil.copytree(ROOT / "txl_deploy", dest / "txl_deploy", ignore=ignore)
    for name in ("exporters", "runtimes"):
        shutil.copytree(ROOT / name, dest / "txl_deploy" / name, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


def _lint(root: Path) -> subprocess.CompletedProcess:
    # grimp reads the staged copy from PYTHONPATH; the checkout's own package must not be found instead.
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "pyproject.toml", "--no-cache"], cwd=root, env=env,
                          capture_output=True, text=True)


def test_import_contracts_hold(tmp_path):
    r = _lint(_installed_layout(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


def test_an_import_that_climbs_a_layer_is_caught(tmp_path):
    """The contracts can fail: the graph contract importing the runtimes (a layer above it) breaks them."""
    root = _installed_layout(tmp_path)
    io_spec = root / "txl_deploy" / "contract" / "io_spec.py"
    io_spec.write_text(io_spec.read_text() + "\nfrom txl_deploy.runtimes import runtime  # noqa: E402,F401\n")
    r = _lint(root)
    assert r.returncode != 0
    assert "txl_deploy.contract is not allowed to import txl_deploy.runtimes" in r.stdout.replace("\n", " ")
