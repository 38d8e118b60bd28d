"""The event representations a music Transformer-XL's vocabulary can be written in, and telling them apart.

An event is a `Name_Value` symbol kept verbatim: REMI's names hold spaces (`Note On_60`), remi-xl's hold
underscores (`Note_Pitch_60`), so a symbol is split at the end of the longest name of its representation, never on
whitespace. Facts from the projects' own code (YatingMusic/remi utils.py, compound-word-transformer's remi-xl):
../shared/reference/music.md in the checkout's reference notes; docs/music.md for users.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from txl_deploy.errors import InputError


@dataclass(frozen=True)
class Representation:
    """One event vocabulary's conventions. `names`: its event names, longest first where one begins another;
    `marks`: names only it has (how it is recognised); `bar`: the event that opens a bar; `end`: the event that
    ends a piece, if it has one."""

    name: str
    description: str
    names: tuple[str, ...]
    marks: tuple[str, ...]
    bar: str
    end: str | None = None

    def split(self, symbol: str) -> tuple[str, str] | None:
        """(event name, value) of `symbol`, or None if it is not an event of this representation."""
        for name in self.names:
            if symbol.startswith(name + "_"):
                return name, symbol[len(name) + 1:]
        return None

    def fits(self, symbols: Iterable[str]) -> bool:
        """Every symbol is one of its events (special symbols such as `<pad>` aside) and one of its marks is used."""
        seen = set()
        for symbol in symbols:
            if symbol.startswith("<") and symbol.endswith(">"):
                continue
            parts = self.split(symbol)
            if parts is None:
                return False
            seen.add(parts[0])
        return any(mark in seen for mark in self.marks)


REMI = Representation(
    "remi", "REMI (Pop Music Transformer): Bar, Position_k/16, Note Velocity/On/Duration, Tempo Class/Value, Chord",
    names=("Bar", "Position", "Note Velocity", "Note On", "Note Duration", "Tempo Class", "Tempo Value", "Chord"),
    marks=("Position", "Note On"), bar="Bar_None")
REMI_XL = Representation(
    "remi-xl", "remi-xl (Compound Word Transformer's REMI baseline): Bar, Beat, Note_Pitch/Velocity/Duration, "
    "Tempo, Chord, EOS",
    names=("Bar", "EOS", "Beat", "Note_Pitch", "Note_Velocity", "Note_Duration", "Tempo", "Chord"),
    marks=("Beat", "Note_Pitch"), bar="Bar_None", end="EOS_None")
REPRESENTATIONS = {r.name: r for r in (REMI, REMI_XL)}


def detect(symbols: Iterable[str]) -> Representation | None:
    """The representation whose events `symbols` are, or None (not a music vocabulary we can write as MIDI)."""
    symbols = list(symbols)
    for representation in REPRESENTATIONS.values():
        if representation.fits(symbols):
            return representation
    return None


def representation(name: str) -> Representation:
    """The representation called `name` (an override of what detection finds); a one-line error otherwise."""
    try:
        return REPRESENTATIONS[name]
    except KeyError:
        raise InputError(f"unknown music representation {name!r}: expected one of "
                         f"{', '.join(REPRESENTATIONS)}") from None


def of_vocab(vocab) -> Representation | None:
    """The representation a model's vocabulary (`txl_deploy.vocab.Vocab`) is written in: an events vocabulary's
    stored one (an unknown name: a one-line error), else the one its events show; None for any other vocabulary."""
    if vocab is None or getattr(vocab, "kind", None) != "events":
        return None
    if vocab.representation is not None:
        return representation(vocab.representation)
    return detect(vocab.symbols)
