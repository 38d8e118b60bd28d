"""The README's table of extras is how a reader finds what to install: it names every extra pyproject.toml
declares, and nothing that is not one."""

from __future__ import annotations

import re

import tomllib
from helpers.paths import ROOT

ROW = re.compile(r"^\| `(?P<extra>[a-z0-9-]+)` \|", re.MULTILINE)


def _table_extras(readme: str) -> list[str]:
    section = readme.split("## Install into your own environment", 1)[1].split("\n## ", 1)[0]
    return ROW.findall(section)


def test_the_extras_table_lists_every_extra_in_pyproject():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                   ["project"]["optional-dependencies"])
    listed = _table_extras((ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(listed) == len(set(listed)), f"listed twice: {listed}"
    assert sorted(declared - set(listed)) == [], "extras missing from the README's table"
    assert sorted(set(listed) - declared) == [], "the README's table lists extras pyproject.toml lacks"


def test_the_check_sees_a_missing_row():
    readme = "## Install into your own environment\n\n| extra | for |\n|---|---|\n| `cpu` | x |\n\n## Next\n| `gpu` | y |\n"
    assert _table_extras(readme) == ["cpu"]


# `pip install -e '.[serve]'` or `pip install '.[cpu]'`: the checkout the reader has, with the extras named.
CHECKOUT_LINE = re.compile(r"pip install (?:-e )?'\.\[(?P<extras>[a-z0-9,-]+)\]'")


def _reader_texts() -> dict[str, str]:
    """README, every docs page, and the source of every command's help and the Triton repository's README."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "txl_deploy").rglob("*.py"))]
    # errors.install_hint names the published package where txl-deploy was installed from it: the one exception
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths if p.name != "errors.py"}


def test_install_lines_install_the_checkout_with_declared_extras():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
                   ["project"]["optional-dependencies"])
    for name, text in _reader_texts().items():
        # the published name would fetch another copy (or nothing) instead of the checkout the reader follows
        assert "install 'txl-deploy[" not in text and "install txl-deploy[" not in text, name
        for line in CHECKOUT_LINE.finditer(text):
            assert set(line["extras"].split(",")) <= declared, (name, line[0])
