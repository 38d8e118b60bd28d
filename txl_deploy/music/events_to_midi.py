"""Event lists to MIDI, as each project's own writer places them.

REMI (YatingMusic/remi utils.py `write_midi`): 480 ticks a beat, 4/4, a bar of 16 positions 120 ticks apart. Each
event is read with the three after it, so the last three events start nothing (upstream loops over all but the last
three). `Bar` opens the next bar, except as the very first event; a note is `Position`, `Note Velocity`, `Note On`,
`Note Duration` in that order (velocity 4v, duration 60 (d + 1) ticks), a chord marker `Position`, `Chord`, a tempo
change `Position`, `Tempo Class`, `Tempo Value` (bpm 30, 90 or 150 plus the value). Any other run is skipped: an
incomplete group places nothing, and the events after it are read afresh.

remi-xl (compound-word-transformer workspace/uncond/remi-xl/model.py `wrtie_midi`): 480 ticks a beat, 1920 a bar.
Every `Bar` (the first included, so the first bar starts at tick 1920) moves on a bar; `Beat_b` sets the time to the
bar's start plus 120 b; `Chord_root_quality` writes a marker `root_quality` and `Tempo_bpm` a tempo change there; a note
is `Note_Pitch`, `Note_Velocity`, `Note_Duration` with raw values (a duration of 0 sounds 60 ticks), also read with
the events after it within the list's last three. `EOS_None` ends the piece: what follows it is not placed (upstream
generates on past it and writes the rest too).

An event that is not one of the representation's (a misspelt name, a value outside its vocabulary's range) is a
one-line `InputError`; special symbols such as `<eos>` are skipped. Every other list is placed, never refused.
"""

from __future__ import annotations

import re

from txl_deploy.errors import InputError
from txl_deploy.music import representation as representations
from txl_deploy.music.midi_file import Note, Score, save_midi, score_to_midi
from txl_deploy.music.representation import REMI, Representation

# REMI's bins (remi utils.py): 16 positions a bar, velocity bin edges 0, 4, ..., 128 (the last has no MIDI velocity),
# 64 durations of 60 (d + 1) ticks, tempo classes starting at 30, 90 and 150 bpm and 60 values wide
TICKS_PER_BAR = 1920
TICKS_PER_POSITION = 120
POSITIONS = 16
VELOCITY_STEP = 4
VELOCITY_BINS = 32
DURATION_STEP = 60
DURATION_BINS = 64
TEMPO_CLASS_START = {"slow": 30, "mid": 90, "fast": 150}
TEMPO_VALUES = 60

# remi-xl's raw values: 16 beats (16th notes) a bar, MIDI pitch and velocity, durations and tempos in ticks and bpm
BEATS = 16
MAX_DURATION = 1 << 20  # ticks; its data's longest is a few bars
TEMPO_BPM = (4, 1000)  # a MIDI tempo (microseconds a beat, 24 bits) holds 4 bpm and up

_POSITION = re.compile(r"([0-9]{1,2})/16")
_INTEGER = re.compile(r"[0-9]{1,7}")
_MARKER_TEXT = re.compile(r"[!-~]{1,64}")  # printable ASCII without spaces, as chord names are


def events_to_midi(events, representation="remi"):
    """The MIDI file (a `mido.MidiFile`, 480 ticks a beat) the project's writer makes of `events` (symbols such as
    `Note On_60`), for the representation `"remi"` or `"remi-xl"` (a name or a `Representation`)."""
    return score_to_midi(events_to_score(events, representation))


def write_midi(events, representation, path, force: bool = False) -> Score:
    """Write `events_to_midi(events, representation)` to `path`, atomically (an existing file only with `force`);
    what was placed."""
    score = events_to_score(events, representation)
    save_midi(score_to_midi(score), path, force=force)
    return score


def as_representation(representation) -> Representation:
    """`representation` itself, or the one its name names (a one-line error for another name)."""
    if isinstance(representation, Representation):
        return representation
    return representations.representation(representation)


def events_to_score(events, representation="remi") -> Score:
    """The notes, tempo changes and chord markers the writer places for `events`, in ticks."""
    rep = as_representation(representation)
    parsed = _parse(events, rep)
    return _place_remi(parsed) if rep is REMI else _place_remi_xl(parsed)


def value_readers(representation) -> dict:
    """Per event name of the representation, what reads an event's value as its writer uses it (None: the writer
    cannot place it). The grammar allows exactly these values, so the writer places whatever it lets through."""
    return _REMI_VALUES if as_representation(representation) is REMI else _REMI_XL_VALUES


def _parse(events, rep: Representation) -> list[tuple[str, object]]:
    """(name, value) of each event, the value converted as the writer uses it; special symbols left out."""
    parse_value = value_readers(rep)
    parsed = []
    for index, symbol in enumerate(events):
        if not isinstance(symbol, str):
            raise InputError(f"event {index}: {symbol!r} is not an event symbol (a string)")
        if symbol.startswith("<") and symbol.endswith(">"):
            continue
        parts = rep.split(symbol)
        value = None if parts is None else parse_value[parts[0]](parts[1])
        if value is None:
            raise InputError(f"event {index}: {symbol[:80]!r} is not a {rep.name} event")
        parsed.append((parts[0], value))
    return parsed


def _integer(low: int, high: int):
    """A parser of an integer value in [low, high] (None for anything else)."""
    def parse(text: str):
        return int(text) if _INTEGER.fullmatch(text) and low <= int(text) <= high else None
    return parse


def _none(text: str):
    return text if text == "None" else None


def _position(text: str):
    match = _POSITION.fullmatch(text)
    return int(match[1]) - 1 if match and 1 <= int(match[1]) <= POSITIONS else None


def _marker(text: str):
    return text if _MARKER_TEXT.fullmatch(text) else None


def _remi_xl_chord(text: str):
    """`root_quality` (e.g. `C_M`, `N_N`): the marker text upstream writes."""
    parts = text.split("_")
    return text if len(parts) == 2 and all(parts) and _marker(text) else None


_REMI_VALUES = {
    "Bar": _none,
    "Position": _position,
    "Note Velocity": _integer(0, VELOCITY_BINS - 1),
    "Note On": _integer(0, 127),
    "Note Duration": _integer(0, DURATION_BINS - 1),
    "Chord": _marker,
    "Tempo Class": lambda text: text if text in TEMPO_CLASS_START else None,
    "Tempo Value": _integer(0, TEMPO_VALUES - 1),
}
_REMI_XL_VALUES = {
    "Bar": _none,
    "EOS": _none,
    "Beat": _integer(0, BEATS - 1),
    "Note_Pitch": _integer(0, 127),
    "Note_Velocity": _integer(0, 127),
    "Note_Duration": _integer(0, MAX_DURATION),
    "Tempo": _integer(*TEMPO_BPM),
    "Chord": _remi_xl_chord,
}


def _names(parsed, i: int, *names: str) -> bool:
    return all(parsed[i + k][0] == name for k, name in enumerate(names))


def _place_remi(parsed) -> Score:
    score = Score()
    bar = 0
    for i in range(len(parsed) - 3):
        name, value = parsed[i]
        if name == "Bar":
            bar += i > 0
            continue
        if name != "Position":
            continue
        start = bar * TICKS_PER_BAR + value * TICKS_PER_POSITION
        if _names(parsed, i, "Position", "Note Velocity", "Note On", "Note Duration"):
            velocity, pitch, duration = (parsed[i + k][1] for k in (1, 2, 3))
            score.notes.append(Note(start, start + DURATION_STEP * (duration + 1), pitch, VELOCITY_STEP * velocity))
        elif _names(parsed, i, "Position", "Chord"):
            score.markers.append((start, parsed[i + 1][1]))
        elif _names(parsed, i, "Position", "Tempo Class", "Tempo Value"):
            score.tempos.append((start, TEMPO_CLASS_START[parsed[i + 1][1]] + parsed[i + 2][1]))
    return score


def _place_remi_xl(parsed) -> Score:
    score = Score(track_name="piano")
    end = len(parsed) - 3
    for i, (name, _) in enumerate(parsed):
        if name == "EOS":
            end = min(end, i)
            break
    bar, now = 0, 0
    for i in range(end):
        name, value = parsed[i]
        if name == "Bar":
            bar += 1
        elif name == "Beat":
            now = bar * TICKS_PER_BAR + value * TICKS_PER_POSITION
        elif name == "Chord":
            score.markers.append((now, value))
        elif name == "Tempo":
            score.tempos.append((now, value))
        elif _names(parsed, i, "Note_Pitch", "Note_Velocity", "Note_Duration"):
            pitch, velocity, duration = (parsed[i + k][1] for k in (0, 1, 2))
            score.notes.append(Note(now, now + (duration or DURATION_STEP), pitch, velocity))
    return score

