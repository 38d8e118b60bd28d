"""The examples of README.md and docs/*.md are tests: what a reader would paste must run.

Every fenced ```python block runs, and every ```bash (or sh, shell, console) block whose commands are all
`txl-deploy` commands, unless an HTML comment right before the fence says why it cannot run here:

    <!-- not run: needs an NVIDIA GPU -->

A shell block with any other command (pip, docker, a script) must carry such a comment; a comment with no reason,
or before a block of another language, is an error. docs/development.md tells writers the same.

How a block runs: in a fresh folder of its own, as if it were the checkout root of a reader who followed the
README. The folder holds `model.onnx` (what the README's quickstart block exported: that block runs first, once)
and, for shell blocks, `txl_deploy/assets/demo/`, and nothing the checkout root lacks: an example that reads a
file of its own (a `heldout.txt`) fails here as it fails for a reader (Python blocks find the demo through `txl_deploy.assets`; a `txl_deploy/` folder without
the package beside a Python script would shadow the installed package). A block that writes `model.onnx` itself
(`-o model.onnx`) starts without one. Python blocks run as a script in a fresh interpreter (this one), shell blocks
command by command in bash, with this environment's `txl-deploy` first on PATH. A failure names the file and line.

Blocks that do not run are still checked: Python compiles, and every `txl-deploy` command in a block or in inline
code names a real command and real options.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from helpers.doc_examples import PAGES, Block, all_blocks, is_cli, parse, parse_text
from helpers.paths import ROOT

from txl_deploy.assets import DEMO_DIR
from txl_deploy.cli.main import main as cli_group

TIMEOUT_S = 600

WRITES_MODEL = re.compile(r"(?:^|\s)(?:-o|--output)(?:\s+|=)model\.onnx(?:\s|$)", re.MULTILINE)
INLINE_CLI = re.compile(r"`(txl-deploy(?:\s[^`]*)?)`")

ALL_BLOCKS = all_blocks()
RUNNABLE = [b for b in ALL_BLOCKS if b.runnable()]


# -- static checks of every block ----------------------------------------------------------------------------------
def test_every_block_runs_or_says_why_not():
    problems = [p for page in PAGES for p in parse(page)[1]]
    assert not problems, "\n".join(problems)
    assert RUNNABLE, "no runnable examples found"


def test_a_not_run_comment_applies_to_the_next_block_across_blank_lines():
    """The parser the docs test and the serving examples' test share: a comment a blank line away from its fence
    still marks that block (so neither test loses it), and only that block."""
    page = """<!-- not run: needs a running txl-deploy serve (the serving tests run it) -->

```bash
curl -s http://127.0.0.1:8000/v1/models
```
<!-- not run: needs an NVIDIA GPU -->


```python
import tensorrt
```
```bash
txl-deploy --help
```
"""
    blocks, problems = parse_text(page, "page.md")
    assert not problems
    assert [(b.line, b.not_run is not None, b.needs_server, b.runnable()) for b in blocks] == [
        (3, True, True, False), (9, True, False, False), (12, False, False, True)]
    assert parse_text("<!-- not run: why -->\n\nplain text\n", "page.md")[1] == [
        "page.md:1: a not-run comment that no code block follows"]


def test_python_blocks_that_do_not_run_still_compile():
    for block in ALL_BLOCKS:
        if block.kind == "python" and not block.runnable():
            compile(block.code, block.where, "exec")


def _option_names(command: click.Command) -> set[str]:
    names = {"-h", "--help"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def _check_cli(text: str) -> str | None:
    """What is wrong with one `txl-deploy ...` command line (placeholders and [optional] parts allowed)."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        tokens = text.split()
    words = [w for tok in tokens[1:] for w in tok.strip("[]()").split("|") if w and w != "..."]
    group_options = _option_names(cli_group)
    i = 0
    while i < len(words) and words[i].startswith("-"):
        if words[i] not in group_options:
            return f"{words[i]} is not an option of txl-deploy itself"
        i += 1
    if i == len(words) or not re.fullmatch(r"[a-z][a-z0-9-]*", words[i]):
        return None  # `txl-deploy`, `txl-deploy -v COMMAND`
    command = cli_group.commands.get(words[i])
    if command is None:
        return f"there is no command {words[i]!r}"
    known = _option_names(command)
    for word in words[i + 1:]:
        name = word.split("=", 1)[0]
        if name.startswith("-") and not re.fullmatch(r"-\d.*", name) and name not in known:
            return f"{name} is not an option of txl-deploy {words[i]}"
    return None


def test_txl_deploy_commands_name_real_commands_and_options():
    wrong = []
    for block in ALL_BLOCKS:
        if block.kind == "shell":
            for line, cmd in block.commands():
                problem = _check_cli(cmd) if is_cli(cmd) else None
                if problem:
                    wrong.append(f"{block.page}:{line}: {problem}: {cmd}")
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT)
        for m in INLINE_CLI.finditer(text):  # a code span may wrap to the next line
            span = " ".join(m[1].split())
            problem = _check_cli(span)
            if problem:
                wrong.append(f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {problem}: `{span}`")
    assert not wrong, "\n".join(wrong)


def test_the_option_check_can_fail():
    assert _check_cli("txl-deploy export model --no-such-option") is not None
    assert _check_cli("txl-deploy no-such-command") is not None
    assert _check_cli("txl-deploy export CKPT --precision int4 [--block-size 32] -o model-int4.onnx") is None


# -- running the runnable ones -------------------------------------------------------------------------------------
def _setup_block() -> Block:
    """The README's block that exports model.onnx: every other example starts from what it wrote."""
    found = [b for b in RUNNABLE if b.page == "README.md" and WRITES_MODEL.search(b.code)]
    assert len(found) == 1, ("README.md must have exactly one runnable block that exports model.onnx (the examples' "
                             f"starting point), found {[b.where for b in found]}")
    return found[0]


@pytest.fixture(scope="session")
def example_home(tmp_path_factory) -> Path:
    """What every example's folder starts from: a copy of the demo assets, and model.onnx as the README's
    quickstart exports it. That block runs here, once; its own test reports how it went."""
    home = tmp_path_factory.mktemp("docs-examples")
    shutil.copytree(DEMO_DIR, home / "checkout" / "txl_deploy" / "assets" / "demo")
    setup = _setup_block()
    work = _folder(setup, home, home / "readme")
    failure = _run(setup, work, home)
    if failure is None:
        shutil.copy(work / "model.onnx", home / "model.onnx")
    home.joinpath("setup-failure.txt").write_text(failure or "", encoding="utf-8")
    return home


def _bin_dir(home: Path) -> Path:
    """A folder whose `txl-deploy` is this environment's command line."""
    here = Path(sys.executable).parent
    if (here / "txl-deploy").is_file():
        return here
    shim = home / "bin"
    shim.mkdir(exist_ok=True)
    script = shim / "txl-deploy"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c "
                      "'import sys; sys.argv[0] = \"txl-deploy\"; from txl_deploy.cli import main; main()' \"$@\"\n")
    script.chmod(0o755)
    return shim


def _folder(block: Block, home: Path, parent: Path) -> Path:
    work = parent / "work"
    work.mkdir(parents=True)
    if not WRITES_MODEL.search(block.code):
        shutil.copy(home / "model.onnx", work)
    if block.kind == "shell":
        (work / "txl_deploy").symlink_to(home / "checkout" / "txl_deploy", target_is_directory=True)
    return work


def _report(where: str, what: str, r: subprocess.CompletedProcess) -> str:
    def tail(text):
        return "\n".join(text.strip().splitlines()[-40:])

    return (f"{where}: the example failed (exit code {r.returncode})\n--- the example\n{what}\n"
            f"--- stdout\n{tail(r.stdout)}\n--- stderr\n{tail(r.stderr)}")


def _run(block: Block, work: Path, home: Path) -> str | None:
    """Run a block in `work`: None, or why it failed."""
    env = dict(os.environ, PATH=f"{_bin_dir(home)}{os.pathsep}{os.environ.get('PATH', '')}")
    if block.kind == "python":
        script = work / "example.py"
        script.write_text(block.code, encoding="utf-8")
        r = subprocess.run([sys.executable, script.name], check=False, cwd=work, env=env, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
        if not r.returncode:
            return None
        lines = re.findall(r'example\.py", line (\d+)', r.stderr)  # the traceback's last frame in the block
        where = f"{block.page}:{block.line + int(lines[-1])}" if lines else block.where
        return _report(where, block.code, r)
    for line, cmd in block.commands():
        r = subprocess.run(["bash", "-c", cmd], check=False, cwd=work, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if r.returncode:
            return _report(f"{block.page}:{line}", cmd, r)
    return None


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_example_runs(block, example_home, tmp_path):
    if block is _setup_block():  # it ran in the fixture
        failure = example_home.joinpath("setup-failure.txt").read_text(encoding="utf-8") or None
    else:
        assert example_home.joinpath("model.onnx").is_file(), (
            f"{_setup_block().where}, which exports the model.onnx every example starts from, failed")
        failure = _run(block, _folder(block, example_home, tmp_path), example_home)
    assert failure is None, failure


def test_an_example_reading_a_file_the_checkout_lacks_fails(example_home, tmp_path):
    """The folders stand for the checkout root: a file a reader would not have there is not there either."""
    blocks, _ = parse_text("```bash\ntxl-deploy eval model.onnx --text heldout.txt\n```\n", "page.md")
    assert _run(blocks[0], _folder(blocks[0], example_home, tmp_path), example_home) is not None
