"""Valid music by construction: which events a representation's MIDI writer places, as a small state machine over
event names, compiled once per vocabulary to token masks.

The state is the last event's name and the position reached in the current bar. A grammar says, per last event
name, which names may follow (`follows`), which values each name's writer can read (`values`), which event sets
the position in a bar (`position`) and whether it may repeat there. Compiled against a vocabulary's symbols it is
one boolean mask [V] per (last name, position): each step is a mask lookup and an O(1) state update. The orders
are the ones the projects' own writers read (YatingMusic/remi utils.py `write_midi`, compound-word-transformer's
remi-xl `wrtie_midi`) and their data is written in; docs/music.md ("Valid music by construction") lists them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.music.events_to_midi import value_readers
from txl_deploy.music.representation import REMI, REMI_XL, Representation, detect, representation

logger = logging.getLogger(__name__)
START = ""  # the last event name before any event


def in_bar(read: Callable[[str], int | None]) -> Callable[[str], int | None]:
    """A writer's reader of a position in the bar (0 = the first) as the grammar counts it (1 = the first)."""
    def position(value: str) -> int | None:
        k = read(value)
        return None if k is None else k + 1
    return position


def writer_values(rep: Representation) -> dict[str, Callable[[str], object]]:
    """The values the representation's MIDI writer reads (events_to_midi's readers, the one place that says which
    values it places), with the positions counted from 1."""
    readers = dict(value_readers(rep))
    position = "Position" if rep is REMI else "Beat"
    readers[position] = in_bar(readers[position])
    return readers


@dataclass(frozen=True)
class Grammar:
    """The event orders a representation's writer places. `follows[name]`: the names that may come after an
    event called `name` (START: first). `values[name]` reads a value the writer can use (None: it cannot; the
    writer's own readers, `writer_values`); for the `position` event it gives the position in the bar, 1 = the
    first. `repeat_position`: the position may stay where it is (REMI repeats it before every note) rather than
    only increase. The bar event (`representation.bar`) starts the positions again."""

    representation: Representation
    follows: Mapping[str, tuple[str, ...]]
    values: Mapping[str, Callable[[str], int | None]]
    position: str
    repeat_position: bool
    n_positions: int = 16

    @property
    def name(self) -> str:
        return self.representation.name


# REMI: Bar, then groups in time order, each opened by its Position: Position Note Velocity, Note On, Note Duration
# (a note), Position Chord, Position Tempo Class, Tempo Value. write_midi places only these whole groups.
REMI_GRAMMAR = Grammar(
    REMI,
    follows={START: ("Bar",),
             "Bar": ("Position", "Bar"),
             "Position": ("Note Velocity", "Chord", "Tempo Class"),
             "Note Velocity": ("Note On",),
             "Note On": ("Note Duration",),
             "Note Duration": ("Position", "Bar"),
             "Chord": ("Position", "Bar"),
             "Tempo Class": ("Tempo Value",),
             "Tempo Value": ("Position", "Bar")},
    values=writer_values(REMI),
    position="Position", repeat_position=True)

# remi-xl: Bar, then per beat in time order Beat_k, an optional Chord, an optional Tempo and the beat's notes
# (Note_Pitch, Note_Velocity, Note_Duration); a piece ends Bar, EOS. wrtie_midi places an event at the last Beat,
# so one must come after each Bar.
REMI_XL_GRAMMAR = Grammar(
    REMI_XL,
    follows={START: ("Bar",),
             "Bar": ("Beat", "Bar", "EOS"),
             "EOS": ("Bar",),
             "Beat": ("Chord", "Tempo", "Note_Pitch"),
             "Chord": ("Tempo", "Note_Pitch", "Beat", "Bar"),
             "Tempo": ("Note_Pitch", "Beat", "Bar"),
             "Note_Pitch": ("Note_Velocity",),
             "Note_Velocity": ("Note_Duration",),
             "Note_Duration": ("Note_Pitch", "Beat", "Bar")},
    values=writer_values(REMI_XL),
    position="Beat", repeat_position=False)

GRAMMARS = {g.name: g for g in (REMI_GRAMMAR, REMI_XL_GRAMMAR)}


def grammar(name: str) -> Grammar:
    """The grammar of the representation called `name`; a one-line error otherwise."""
    try:
        return GRAMMARS[name]
    except KeyError:
        raise InputError(f"unknown grammar {name!r}: expected one of {', '.join(GRAMMARS)}") from None


class CompiledGrammar:
    """A grammar against one vocabulary. `kind[v]`: the index of token v's event name in `names` (-1: not an
    event the writer can place, never allowed), `position[v]` its position (0: none). `masks[n, p]`: the tokens
    allowed after an event called names[n] at position p of the bar."""

    def __init__(self, grammar: Grammar, symbols: Iterable[str]):
        self.grammar = g = grammar
        self.symbols = list(symbols)
        if not g.representation.fits(self.symbols):
            found = detect(self.symbols)
            raise InputError(f"the {g.name} grammar needs a vocabulary of {g.name} events; this one's symbols are "
                             + (f"{found.name} events" if found else "not music events"))
        self.names = (START,) + tuple(name for name in g.follows if name != START)
        index = {name: n for n, name in enumerate(self.names)}
        V = len(self.symbols)
        self.kind = np.full(V, -1, dtype=np.int64)
        self.position = np.zeros(V, dtype=np.int64)
        for v, symbol in enumerate(self.symbols):
            parts = g.representation.split(symbol)
            if parts is None or parts[0] not in index or parts[0] == START:
                continue
            value = g.values[parts[0]](parts[1])
            if value is not None:
                self.kind[v] = index[parts[0]]
                self.position[v] = value if parts[0] == g.position else 0
        self.bar = index[g.representation.split(g.representation.bar)[0]]
        self.position_kind = index[g.position]
        P = g.n_positions + 1
        at = np.arange(P)[:, None]
        # the position tokens allowed once the bar has reached position p
        places = (self.kind == self.position_kind)[None, :] & (
            self.position[None, :] >= np.maximum(at, 1) if g.repeat_position else self.position[None, :] > at)
        self.masks = np.zeros((len(self.names), P, V), dtype=bool)
        for n, name in enumerate(self.names):
            for follower in g.follows[name]:
                f = index[follower]
                self.masks[n] |= places if f == self.position_kind else (self.kind == f)[None, :]
        self._check_complete()

    def _check_complete(self):
        """Every state a piece can reach leaves some token: a vocabulary lacking an event the grammar needs (no
        Note Duration, say) is refused now, in one line, not in the middle of a piece."""
        seen, todo = set(), [(0, 0)]
        while todo:
            n, p = todo.pop()
            if (n, p) in seen:
                continue
            seen.add((n, p))
            allowed = np.flatnonzero(self.masks[n, p])
            if not allowed.size:
                after = self.names[n] or "the start"
                raise InputError(f"the {self.grammar.name} grammar cannot continue after {after!r} with this "
                                 f"vocabulary: it has none of {', '.join(self.grammar.follows[self.names[n]])}")
            for k, q in {(int(self.kind[v]), int(self.position[v])) for v in allowed}:
                todo.append(self._next(n, p, k, q))

    def _next(self, n: int, p: int, k: int, q: int) -> tuple[int, int]:
        if k < 0:  # not an event (a prompt's special symbol): the state stays
            return n, p
        return k, (q if k == self.position_kind else 0 if k == self.bar else p)

    def to_dict(self) -> dict:
        """What a browser page needs to compile the same masks (exporters/web's txl.js `Grammar`): the event names,
        which follow which (indices), each token's event (-1: never allowed) and bar position."""
        g = self.grammar
        return {"name": g.name, "names": list(self.names),
                "follows": [[self.names.index(f) for f in g.follows[name]] for name in self.names],
                "kind": self.kind.tolist(), "position": self.position.tolist(), "position_kind": self.position_kind,
                "bar": self.bar, "repeat_position": g.repeat_position, "n_positions": g.n_positions}

    def start(self, context=()) -> GrammarState:
        """A stream's state after `context` (token ids), the constraint its sampler applies."""
        return GrammarState(self).follow(context)

    def first_error(self, ids) -> int | None:
        """The index of the first token of `ids` (a piece from its start) the grammar does not allow, or None."""
        state = GrammarState(self)
        for i, tok in enumerate(np.asarray(ids, dtype=np.int64).reshape(-1).tolist()):
            if not 0 <= tok < len(self.symbols) or not state.allowed()[tok]:
                return i
            state.advance(tok)
        return None


class GrammarState:
    """One stream's place in the grammar: `allowed()` the mask of the next token, `advance(token)` after it. A
    prompt is followed whatever it holds (a token the grammar would not allow sets the state as it would)."""

    def __init__(self, compiled: CompiledGrammar):
        self.compiled = compiled
        self.last, self.at = 0, 0

    def allowed(self) -> np.ndarray:
        return self.compiled.masks[self.last, self.at]

    def follow(self, context) -> GrammarState:
        """This state advanced over `context` (token ids)."""
        for tok in np.asarray(context, dtype=np.int64).reshape(-1).tolist():
            self.advance(tok)
        return self

    def advance(self, token: int) -> None:
        c = self.compiled
        if 0 <= token < c.kind.size:
            self.last, self.at = c._next(self.last, self.at, int(c.kind[token]), int(c.position[token]))

    @property
    def after(self) -> str:
        """The last event name followed (\"\" at the start)."""
        return self.compiled.names[self.last]


@functools.lru_cache(maxsize=8)
def _compiled(name: str, symbols: tuple[str, ...]) -> CompiledGrammar:
    return CompiledGrammar(GRAMMARS[name], symbols)


def compiled(which: str | Grammar, vocab) -> CompiledGrammar:
    """`which` (a grammar or its name) compiled against a vocabulary (a Vocab, or its list of symbols), once per
    vocabulary (kept for reuse)."""
    if vocab is None:
        raise InputError("a grammar needs the model's vocabulary, to know which token is which event; this model "
                         "has none")
    symbols = tuple(getattr(vocab, "symbols", vocab))
    g = grammar(which) if isinstance(which, str) else which
    if not isinstance(g, Grammar):
        raise InputError(f"grammar must be a grammar's name ({', '.join(GRAMMARS)}), got {type(which).__name__}")
    return _compiled(g.name, symbols) if GRAMMARS.get(g.name) is g else CompiledGrammar(g, symbols)


def detected(vocab) -> CompiledGrammar | None:
    """The grammar of the representation a vocabulary is written in (the one it names, as an events vocabulary
    may, else the one its symbols show), compiled; None when they are not music events (or lack an event the
    grammar needs: then it says so in the log)."""
    if vocab is None:
        return None
    stored = getattr(vocab, "representation", None)
    found = representation(stored) if isinstance(stored, str) else detect(getattr(vocab, "symbols", vocab))
    if found is None:
        return None
    try:
        return compiled(found.name, vocab)
    except InputError as e:
        logger.warning("%s", e)
        return None


def constraint(which, vocab, context=()) -> GrammarState:
    """The constraint a sampler applies: `which` a grammar or its name, compiled against the vocabulary (a Vocab,
    or its symbols) and started after `context` (token ids); a `CompiledGrammar` (compiled for that vocabulary)
    started after it; or a `GrammarState` (a piece going on from an earlier call) advanced over it."""
    if isinstance(which, GrammarState):
        n = len(getattr(vocab, "symbols", vocab) or ())
        if len(which.compiled.symbols) != n:
            raise InputError(f"the grammar state was compiled for {len(which.compiled.symbols)} symbols, the "
                             f"vocabulary has {n}")
        return which.follow(context)
    return (which if isinstance(which, CompiledGrammar) else compiled(which, vocab)).start(context)


__all__ = ["constraint", "detected", "Grammar", "CompiledGrammar", "GrammarState", "GRAMMARS", "REMI_GRAMMAR",
           "REMI_XL_GRAMMAR", "grammar", "compiled"]
