"""The serving examples of README.md and docs/serving.md run against a real server. The docs test (tests/docs)
cannot start one, so those blocks say `<!-- not run: needs a running txl-deploy serve ... -->`; here they run, with
the server's address in place of 127.0.0.1:8000, against the bundled demo model (served through PyTorch, the
one-memory-per-stream path) under the name the docs use."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from txl_deploy.assets import demo_model_path
from txl_deploy.serving.http.app import ServeSettings
from txl_deploy.serving.http.scheduler import Scheduler
from txl_deploy.serving.http.server import BackgroundServer

ROOT = Path(__file__).resolve().parents[3]
MARK = re.compile(r"^<!--\s*not run:\s*needs a running txl-deploy serve\b.*-->\s*$")
DOCS_URL = "http://127.0.0.1:8000"


def _blocks():
    out = []
    for page in (ROOT / "README.md", ROOT / "docs" / "serving.md"):
        lines = page.read_text(encoding="utf-8").split("\n")
        for i, line in enumerate(lines[:-1]):
            if MARK.match(line) and lines[i + 1].startswith("```"):
                lang = lines[i + 1][3:].strip()
                end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
                out.append((f"{page.name}:{i + 2}", lang, "\n".join(lines[i + 2:end])))
    return out


BLOCKS = _blocks()


def test_the_serving_pages_have_such_examples():
    langs = [lang for _, lang, _ in BLOCKS]
    assert langs.count("bash") >= 3 and langs.count("python") >= 2


@pytest.fixture(scope="module")
def docs_server():
    load = functools.partial(Scheduler.load, demo_model_path(), backend="torch-fast", threads=1, max_batch=4,
                             max_sessions=4)
    with BackgroundServer(load, ServeSettings(model_name="model")) as srv:
        yield srv


def _commands(code: str) -> list[str]:
    return [c for c in code.replace("\\\n", " ").split("\n") if c.strip() and not c.lstrip().startswith("#")]


@pytest.mark.parametrize("where, lang, code", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_example_runs_against_a_server(docs_server, tmp_path, where, lang, code):
    code = code.replace(DOCS_URL, docs_server.url)
    if lang == "python":
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{where}: {r.stderr[-2000:]}"
        assert r.stdout.strip(), where
        return
    assert lang == "bash"
    for command in _commands(code):
        r = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"{where}: {command}: {r.stderr[-1000:]}"
        assert '"error"' not in r.stdout, f"{where}: {command}: {r.stdout[-1000:]}"
        if "/restore" not in command and "-o " not in command:
            assert r.stdout.strip(), f"{where}: {command} printed nothing"
