"""What a command says when an optional dependency is missing: the pip line that installs its extra, in the form
that works where this copy of txl-deploy runs (the checkout itself, editable, or the published package)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from helpers.cli import assert_one_line_error, cli
from helpers.paths import ROOT

from txl_deploy import errors
from txl_deploy.errors import install_hint


def test_in_a_checkout_the_hint_installs_the_checkout(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    assert install_hint("serve") == "pip install -e '.[serve]'"
    assert install_hint("cpu", "torch") == "pip install -e '.[cpu,torch]'"
    monkeypatch.chdir(tmp_path)  # elsewhere, `.` would be the wrong folder: the checkout's path
    assert install_hint("serve") == f"pip install -e '{os.path.realpath(ROOT)}[serve]'"


def test_an_installed_copy_names_the_published_package(monkeypatch, tmp_path):
    package = tmp_path / "site-packages" / "txl_deploy"
    package.mkdir(parents=True)
    monkeypatch.setattr(errors, "__file__", str(package / "errors.py"))
    monkeypatch.chdir(ROOT)
    assert install_hint("serve") == "pip install 'txl-deploy[serve]'"


def test_serve_without_its_extra_gives_the_checkouts_install_line(tmp_path):
    code = textwrap.dedent("""
        import sys
        sys.modules["fastapi"] = None  # as if the serve extra were not installed
        from txl_deploy.cli import main
        main(["serve", sys.argv[1]])
    """)
    model = tmp_path / "model.onnx"
    model.write_bytes(b"")
    r = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT)
    assert r.returncode == 2, r.stderr
    assert "pip install -e '.[serve]'" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_missing_optional_package_names_its_extra(monkeypatch, tiny_ckpt, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # as if the torch extra were not installed
    monkeypatch.chdir(ROOT)
    assert_one_line_error(cli("export", tiny_ckpt, "-o", tmp_path / "m.onnx"), "torch is not installed",
                          "pip install -e '.[torch]'")
