"""Static checks that catch code paths the CPU tests cannot run (GPU-only branches): syntax errors and names used
but never defined (pyflakes' E9/F63/F7/F82 rules, through ruff)."""

from __future__ import annotations

import subprocess
import sys

from helpers.paths import ROOT


def test_no_undefined_names_or_syntax_errors():
    dirs = [str(ROOT / d) for d in ("txl_deploy", "exporters", "runtimes", "benchmarks", "examples", "tools", "tests")
            if (ROOT / d).is_dir()]
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "E9,F63,F7,F82",
                        "--output-format", "concise", *dirs], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
