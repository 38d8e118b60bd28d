"""A song from a music model: the projects' priming, sampling under the grammar, stopping after bars or at the end.

REMI (YatingMusic/remi model.py `generate`) starts from `Bar_None, Position_1/16, <Tempo Class>, <Tempo Value>`
drawn at random from the vocabulary (a chord model first adds `Position_1/16, <Chord>`), or from a prompt's events
followed by `Bar_None`, and samples until it has generated n `Bar_None` events (the last one closes bar n). remi-xl
(compound-word-transformer workspace/uncond/remi-xl/model.py `inference`) starts from `Bar_None` alone and samples
up to a token limit (7680); here it stops at `EOS_None`, after which its writer places nothing.
"""

from __future__ import annotations

import logging

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.music.events_to_midi import as_representation
from txl_deploy.music.representation import REMI, Representation, detect
from txl_deploy.progress import progress_bar

logger = logging.getLogger(__name__)

UPSTREAM_BARS = 16  # REMI's main.py: n_target_bar=16
UPSTREAM_TOKEN_LIMIT = 7680  # remi-xl's inference.py: token_lim=7680


def music_representation(vocab, representation=None) -> Representation:
    """`representation` (a name or a Representation), or the one `vocab`'s symbols are; a one-line error when the
    vocabulary is not one of music events."""
    if representation is not None:
        return as_representation(representation)
    if vocab is None:
        raise InputError("this model has no vocabulary, so its tokens are not music events (pass --representation)")
    found = detect(vocab.symbols)
    if found is None:
        raise InputError("this model's vocabulary is not one of music events (remi, remi-xl); pass "
                         "--representation to read its tokens as one")
    return found


def priming(symbols, representation, chords: bool = False, rng=None) -> list[str]:
    """The events a song starts from, as the representation's project primes it (chords: REMI's chord models)."""
    rep = as_representation(representation)
    if rep is not REMI:
        return [rep.bar]
    rng = np.random.default_rng() if rng is None else rng
    names = [(symbol, (rep.split(symbol) or ("",))[0]) for symbol in symbols]

    def one(name: str) -> str:
        choices = [symbol for symbol, n in names if n == name]
        if not choices:
            raise InputError(f"the vocabulary has no {name} events to start a song with (REMI draws one at random)")
        return choices[int(rng.integers(len(choices)))]

    events = [rep.bar]
    if chords:
        events += ["Position_1/16", one("Chord")]
    return events + ["Position_1/16", one("Tempo Class"), one("Tempo Value")]


def generate_music(rt, representation=None, *, bars: int | None = None, prompt=None, chords: bool = False,
                   max_events: int = UPSTREAM_TOKEN_LIMIT, grammar: bool = True, **sampling) -> list[str]:
    """A song's events from `rt` (a TxlRuntime whose vocabulary's symbols are the events), its memory reset first.

    representation: "remi", "remi-xl" or a Representation (default: what the vocabulary's symbols are).
    bars: stop once this many `Bar_None` events are generated (default: remi-xl at `EOS_None`, REMI after 16, as
    upstream). prompt: events to continue (e.g. `midi_to_events` of a MIDI file), followed by `Bar_None` as REMI
    does; without one, the upstream priming (`priming`, chords for REMI's chord models). max_events: at most this
    many generated events. grammar: sample only what the representation's grammar allows next, so its MIDI writer
    places every event. sampling: `TxlRuntime.generate`'s (temperature, top_k, top_p, seed, ...); the seed also
    draws the priming, so a seeded song is reproducible.

    Returns every event, the priming or prompt included: the list `events_to_midi` writes."""
    rep = music_representation(rt.vocab, representation)
    symbols = list(rt.vocab.symbols)
    index = {symbol: i for i, symbol in enumerate(symbols)}
    if bars is None and rep.end is None:
        bars = UPSTREAM_BARS
    if bars is not None and (isinstance(bars, bool) or not isinstance(bars, int) or bars < 1):
        raise InputError(f"bars must be a whole number of at least 1, got {bars!r}")
    if prompt is None:
        events = priming(symbols, rep, chords, np.random.default_rng(sampling.get("seed")))
    else:
        events = [str(event) for event in prompt] + [rep.bar]
    missing = [event for event in events if event not in index]
    if missing:
        raise InputError(f"the event {missing[0][:80]!r} is not in the model's vocabulary, so it cannot start "
                         "the song")
    stop = list(sampling.pop("stop_token_ids", None) or ())
    if rep.end is not None and rep.end in index:
        stop.append(index[rep.end])
    bar = index.get(rep.bar)
    rt.reset()
    tokens = rt.generate([index[event] for event in events], max_events, stop=stop,
                         grammar=rep.name if grammar else None, **sampling)
    generated = 0
    with progress_bar(total=bars, unit="bar", desc="generating") as shown:
        for token in tokens:
            events.append(symbols[token])
            if token == bar:
                generated += 1
                shown.update()
                if generated == bars:
                    break
    tokens.close()  # the memory gets the last event, as a stream left between calls does
    if bars is not None and generated < bars and events[-1] != rep.end:
        logger.warning("the song stopped at the limit of %d events after %d of %d bars; its last events may be an "
                       "incomplete group the MIDI writer drops", max_events, generated, bars)
    return events


__all__ = ["generate_music", "music_representation", "priming"]
