"""The serving examples of README.md and docs/*.md run against a real server. The docs test (tests/docs) cannot
start one, so those blocks say `<!-- not run: needs a running txl-deploy serve ... -->`; here they run, with the
server's address in place of 127.0.0.1:8000, against the bundled demo model (served through PyTorch, the
one-memory-per-stream path) under the name the docs use. Both tests read the pages with one parser
(helpers.doc_examples), so a block one of them leaves to the other always runs in the other."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest
from helpers.doc_examples import all_blocks

from txl_deploy.assets import demo_model_path
from txl_deploy.serving.http.app import ServeSettings
from txl_deploy.serving.http.scheduler import Scheduler
from txl_deploy.serving.http.server import BackgroundServer

DOCS_URL = "http://127.0.0.1:8000"
BLOCKS = [b for b in all_blocks() if b.needs_server]


def test_the_serving_pages_have_such_examples():
    assert {b.kind for b in BLOCKS} <= {"shell", "python"}, [(b.where, b.lang) for b in BLOCKS]
    kinds = [b.kind for b in BLOCKS]
    assert kinds.count("shell") >= 3 and kinds.count("python") >= 2
    assert {b.page for b in BLOCKS} >= {"README.md", "docs/serving.md"}


@pytest.fixture(scope="module")
def docs_server():
    load = functools.partial(Scheduler.load, demo_model_path(), backend="torch-fast", threads=1, max_batch=4,
                             max_sessions=4)
    with BackgroundServer(load, ServeSettings(model_name="model")) as srv:
        yield srv


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_example_runs_against_a_server(docs_server, tmp_path, block):
    if block.kind == "python":
        code = block.code.replace(DOCS_URL, docs_server.url)
        r = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{block.where}: {r.stderr[-2000:]}"
        assert r.stdout.strip(), block.where
        return
    for line, command in block.commands():
        command = command.replace(DOCS_URL, docs_server.url)
        where = f"{block.page}:{line}"
        r = subprocess.run(["bash", "-c", command], check=False, cwd=tmp_path, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, f"{where}: {command}: {r.stderr[-1000:]}"
        assert '"error"' not in r.stdout, f"{where}: {command}: {r.stdout[-1000:]}"
        if "/restore" not in command and "-o " not in command:
            assert r.stdout.strip(), f"{where}: {command} printed nothing"
