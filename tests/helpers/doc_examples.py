"""The code blocks of README.md and docs/*.md, for the tests that run them (tests/docs, and the serving examples in
tests/serving/http/test_serve_docs.py): one parser, so a block both see the same way never falls between them.

A block is marked as not run here by an HTML comment before its fence (blank lines between are allowed):
`<!-- not run: REASON -->`. The reason `needs a running txl-deploy serve ...` means the serving tests run it
against a real server instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from helpers.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
PYTHON = {"python", "py"}

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^`]*$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:(?P<reason>.*?)-->\s*$")
NEEDS_SERVER = re.compile(r"^needs a running txl-deploy serve\b")


@dataclass
class Block:
    page: str  # the page's path from the repository root
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    not_run: str | None  # the reason, or None when the block runs

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str | None:
        return "shell" if self.lang in SHELL else "python" if self.lang in PYTHON else None

    @property
    def needs_server(self) -> bool:
        """Marked to run against a running `txl-deploy serve` (which the serving tests start)."""
        return self.not_run is not None and NEEDS_SERVER.match(self.not_run) is not None

    def commands(self) -> list[tuple[int, str]]:
        """Shell commands with their line numbers: continuation lines joined, comments and blank lines dropped;
        in a console block only the `$ ` lines."""
        out, pending, start = [], "", None
        for offset, raw in enumerate(self.code.split("\n"), start=self.line + 1):
            line = raw.rstrip()
            if self.lang == "console" and not pending:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            start = start if pending else offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            out.append((start, pending + line))
            pending = ""
        if pending:
            out.append((start, pending))
        return out

    def runnable(self) -> bool:
        """Whether tests/docs runs it: not marked, and Python, or shell with only `txl-deploy` commands."""
        if self.not_run is not None or self.kind is None:
            return False
        return self.kind == "python" or all(is_cli(cmd) for _, cmd in self.commands())


def is_cli(command: str) -> bool:
    return command.split(maxsplit=1)[0] == "txl-deploy"


def parse_text(text: str, page: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page's text, and what is wrong with its not-run comments."""
    lines = text.split("\n")
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if NOT_RUN.match(lines[i]):
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            if j == len(lines) or not FENCE.match(lines[j]):
                problems.append(f"{page}:{i + 1}: a not-run comment that no code block follows")
            i += 1
            continue
        if not m:
            i += 1
            continue
        indent, fence, lang = m["indent"], m["fence"], m["lang"].lower()
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            problems.append(f"{page}:{i + 1}: a code block that is never closed")
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        reason = None
        if k >= 0 and NOT_RUN.match(lines[k]):
            reason = NOT_RUN.match(lines[k])["reason"].strip()
            if not reason:
                problems.append(f"{page}:{k + 1}: a not-run comment must say why")
        block = Block(page, i + 1, lang, "\n".join(body), reason)
        if reason is not None and block.kind is None:
            problems.append(f"{page}:{k + 1}: a not-run comment before a {lang or 'plain'} block, which never runs")
        if block.kind == "shell" and reason is None and not block.runnable():
            others = [cmd.split()[0] for _, cmd in block.commands() if not is_cli(cmd)]
            problems.append(f"{block.where}: runs {', '.join(sorted(set(others)))}, not only txl-deploy: split it, "
                            "or put <!-- not run: REASON --> before it")
        blocks.append(block)
        i = j + 1
    return blocks, problems


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page of the checkout, and what is wrong with its not-run comments."""
    return parse_text(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))


def all_blocks() -> list[Block]:
    """Every fenced block of README.md and docs/*.md, in page order."""
    return [b for page in PAGES for b in parse(page)[0]]
