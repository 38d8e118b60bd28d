"""The documentation site builds with `mkdocs build --strict`, which fails on a link to a missing page or heading
(mkdocs.yml's `validation` makes every link problem a warning, and strict mode makes warnings errors), and the
README's links, which the site does not check, point at files and headings that exist."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build(project: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml"),
                           "-d", str(site)], check=False, cwd=project, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = build(ROOT, out)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_the_site_builds_in_strict_mode(site):
    assert (site / "index.html").is_file()
    assert (site / "graph-contract" / "index.html").is_file()


@pytest.mark.parametrize("broken", ["[a page that is not there](no-such-page.md)",
                                    "[a heading that is not there](graph-contract.md#no-such-heading)",
                                    "[a heading of this page that is not there](#no-such-heading)"])
def test_strict_mode_fails_on_a_broken_link(tmp_path, broken):
    """The check can fail: a copy of the docs with one broken link or anchor does not build."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "docs", project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project)
    index = project / "docs" / "index.md"
    index.write_text(index.read_text(encoding="utf-8") + f"\nSee {broken}.\n", encoding="utf-8")
    r = build(project, tmp_path / "site")
    assert r.returncode != 0, f"a broken link passed strict mode: {broken}\n{r.stderr}"
    assert "no-such-" in r.stderr


LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def test_the_readme_links_resolve(site):
    """README.md is not part of the site: its relative links are checked here, anchors against the built pages."""
    wrong = []
    for n, line in enumerate((ROOT / "README.md").read_text(encoding="utf-8").split("\n"), start=1):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # an absolute URL
            path, _, anchor = target.partition("#")
            if not (ROOT / path).exists():
                wrong.append(f"README.md:{n}: {target}: no such file")
            elif anchor:
                if not path.startswith("docs/") or not path.endswith(".md"):
                    wrong.append(f"README.md:{n}: {target}: anchors are checked in docs pages only")
                    continue
                page = Path(path).relative_to("docs").with_suffix("")
                html = site / ("index.html" if page.name == "index" else page / "index.html")
                if f'id="{anchor}"' not in html.read_text(encoding="utf-8"):
                    wrong.append(f"README.md:{n}: {target}: no such heading")
    assert not wrong, "\n".join(wrong)
