"""The source layout: a checkout imports exactly as an install does, and the runtimes never import the exporters.

The top-level `exporters/` and `runtimes/` folders become `txl_deploy.exporters` / `txl_deploy.runtimes` through
pyproject's package-dir in an install, and through `txl_deploy/__init__.py` in a checkout.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from helpers.paths import ROOT

IMPORTS = textwrap.dedent("""
    import json, sys
    import txl_deploy.runtimes, txl_deploy.exporters.onnx.export, txl_deploy.runtimes.backends.onnxruntime
    from txl_deploy import TxlRuntime
    assert TxlRuntime is txl_deploy.runtimes.TxlRuntime
    assert "torch" not in sys.modules
    print(json.dumps({m: sys.modules[m].__file__ for m in
                      ("txl_deploy", "txl_deploy.runtimes", "txl_deploy.exporters.onnx.export")}))
""")


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def installed_clone(tmp_path_factory):
    """A fresh clone of this repository (plus the working tree's uncommitted changes and new files), installed
    non-editable (`pip install --no-deps .`) into a throwaway venv that sees this venv's packages through a .pth,
    so the install needs no network and no new dependencies."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    tmp = tmp_path_factory.mktemp("layout")
    clone = tmp / "clone"
    _git("clone", "--quiet", "--no-hardlinks", str(ROOT), str(clone))
    # What is not committed yet is what a developer is testing: the changes to tracked files, and new files.
    diff = subprocess.run(["git", "diff", "HEAD", "--binary"], cwd=ROOT, capture_output=True, check=True).stdout
    if diff:
        subprocess.run(["git", "apply", "--whitespace=nowarn", "-"], cwd=clone, input=diff, check=True)
    for name in _git("ls-files", "--others", "--exclude-standard").splitlines():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, clone / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The test venv's packages (numpy, onnxruntime, setuptools, pip) after the throwaway venv's own; .pth files in
    # that folder are not processed, so the editable install of this checkout stays out of the way.
    # Every site folder of this interpreter (a venv may itself reach its packages through a .pth file).
    folders = [sysconfig.get_paths()["purelib"]] + [p for p in sys.path if p.endswith("site-packages")]
    Path(site, "test-venv.pth").write_text("\n".join(dict.fromkeys(folders)) + "\n")
    r = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--no-index", "--disable-pip-version-check", str(clone)],
                       capture_output=True, text=True, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (Path(site) / "txl_deploy" / "runtimes" / "runtime.py").is_file()  # a real, non-editable install
    return clone, python, Path(site)


def _imports(python, cwd) -> dict:
    import json

    r = subprocess.run([str(python), "-c", IMPORTS], capture_output=True, text=True, cwd=cwd,
                       env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert r.returncode == 0, f"import failed in {cwd}:\n{r.stderr}"
    return {k: Path(v).resolve() for k, v in json.loads(r.stdout).items()}


def test_checkout_root_imports_like_the_install(installed_clone):
    clone, python, site = installed_clone
    files = _imports(python, clone)
    # From the checkout root the checkout's own sources are used, subpackages included (not a mix of both).
    assert files["txl_deploy"] == clone / "txl_deploy" / "__init__.py"
    assert files["txl_deploy.runtimes"] == clone / "runtimes" / "__init__.py"
    assert files["txl_deploy.exporters.onnx.export"] == clone / "exporters" / "onnx" / "export.py"


def test_install_imports_from_any_other_folder(installed_clone, tmp_path):
    clone, python, site = installed_clone
    files = _imports(python, tmp_path)
    for name, path in files.items():
        assert site.resolve() in path.parents, (name, path)


def test_installed_copy_ignores_lookalike_folders_in_the_working_directory(installed_clone, tmp_path):
    """An install must not pick up `exporters/` or `runtimes/` from wherever Python happens to run."""
    clone, python, site = installed_clone
    for name in ("exporters", "runtimes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('picked up from the working directory')\n")
    (tmp_path / "pyproject.toml").write_text("")
    files = _imports(python, tmp_path)
    assert site.resolve() in files["txl_deploy.runtimes"].parents


# -- no import cycle ------------------------------------------------------------------------------------------
def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module an `import` / `from ... import` in this file names, relative imports resolved."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out |= {f"{mod}.{alias.name}" for alias in node.names}
    return out


def test_runtimes_never_import_the_exporters():
    """Exporters import the runtimes (to verify what they wrote); the reverse would be a cycle. What both need
    (the engine file format, the ring-buffer write) lives in txl_deploy/."""
    files = sorted((ROOT / "runtimes").glob("*.py"))
    assert files
    offenders = {}
    for path in files:
        bad = {m for m in _imported_modules(path, "txl_deploy.runtimes")
               if m.split(".")[:2] == ["txl_deploy", "exporters"] or m.split(".")[0] == "exporters"}
        if bad:
            offenders[path.name] = sorted(bad)
    assert not offenders, f"runtimes import exporters: {offenders}"


def test_the_import_scan_sees_relative_and_absolute_imports(tmp_path):
    """The scan above must be able to fail: each spelling of an exporters import is caught."""
    for line in ("from txl_deploy.exporters.tensorrt.build import load_engine", "import txl_deploy.exporters.onnx.export",
                 "from ..exporters import tensorrt", "from txl_deploy import exporters"):
        f = tmp_path / "m.py"
        f.write_text(f"def f():\n    {line}\n")
        found = _imported_modules(f, "txl_deploy.runtimes")
        assert any(m.split(".")[:2] == ["txl_deploy", "exporters"] for m in found), line
