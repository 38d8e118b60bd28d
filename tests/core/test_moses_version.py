"""The streaming Moses decoder's proof (docs/runtime.md) reads sacremoses' detokenizer: the `text` and `test` extras
bound sacremoses to the releases it was checked against, and the installed one lies inside that bound."""

from __future__ import annotations

import importlib.metadata

import tomllib
from helpers.paths import ROOT
from packaging.requirements import Requirement
from packaging.version import Version


def _sacremoses_requirements() -> dict[str, Requirement]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {}
    for extra, requirements in extras.items():
        for text in requirements:
            requirement = Requirement(text)
            if requirement.name == "sacremoses":
                found[extra] = requirement
    return found


def test_both_extras_bound_sacremoses_from_above_alike():
    found = _sacremoses_requirements()
    assert set(found) == {"text", "test"}
    assert found["text"].specifier == found["test"].specifier
    assert any(spec.operator in ("<", "<=", "==", "~=") for spec in found["text"].specifier), \
        f"sacremoses{found['text'].specifier} has no upper bound"
    assert not found["text"].specifier.contains(Version("1000"))


def test_the_installed_sacremoses_is_one_the_proof_was_checked_against():
    installed = importlib.metadata.version("sacremoses")
    bound = _sacremoses_requirements()["text"].specifier
    assert bound.contains(Version(installed)), f"sacremoses {installed} is outside {bound}"
