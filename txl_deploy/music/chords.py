"""The rule-based chord recogniser the Pop Music Transformer's chord events come from, written from its rules.

The rules (YatingMusic/remi chord_recognition.py, `MIDIChord`), in words:
- Candidate spans start on every beat (480 ticks) and last 4 beats, then 2, cut at the end of the last note.
- In a span, every pitch class that sounds (a note of zero length sounds one tick) may be the root. Above a root,
  a minor third (3) without a major third (4) makes `min`, or `dim` with a tritone (6); a major third without a minor
  one makes `maj`, `aug` with 8, or `dom` with both 7 and 10; both thirds or neither make no chord (`None`, score
  -100). The other pitch classes score against the quality's intervals: -1 or -2 for each outside one (by its
  table), +1 for each inside one (the fifth of `maj` and `min`, the sixth of `dim`).
- The span's chord is the best-scoring root, ties broken by the lowest sounding note; its bass is the lowest
  sounding pitch class. A silent span is `N:N`.
- From tick 0, the span with the best score is taken (ties: the longer), and the next starts where it ends.
  `None` chords are then absorbed: leading ones into the first real chord, the others into the chord before.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from txl_deploy.music.midi_file import Note

PITCH_CLASSES = ("C", "C#", "D", "D#", "E", "F", "F#", "G", "G#", "A", "A#", "B")
BEAT = 480
SPANS = (4, 2)  # beats, the longer tried first

# quality: (intervals that make it, +1 intervals, -1 intervals, -2 intervals), from chord_recognition.py
QUALITIES = {
    "maj": ((0, 4), (7,), (2, 5, 9), (1, 3, 6, 8, 10)),
    "min": ((0, 3), (7,), (2, 5, 8), (1, 4, 6, 9, 11)),
    "dim": ((0, 3, 6), (9,), (2, 5, 10), (1, 4, 7, 8, 11)),
    "aug": ((0, 4, 8), (), (2, 5, 9), (1, 3, 6, 7, 10)),
    "dom": ((0, 4, 7, 10), (), (2, 5, 9), (1, 3, 6, 8, 11)),
}
NO_CHORD_SCORE = -100


def recognise_chords(notes: Iterable[Note]) -> list[tuple[int, int, str]]:
    """(start, end, label) of each chord of `notes` (480 ticks a beat), labels `root:quality` or
    `root:quality/bass`; an empty list when no span holds a chord. Memory grows with the beats spanned (a few
    hundred bytes a beat): callers bound them."""
    notes = [n for n in notes if n.velocity > 0]
    if not notes:
        return []
    last_tick = max(n.end for n in notes)
    sounded = _beats_sounded(notes, last_tick)
    spans: dict[int, dict[int, tuple[str, int]]] = {}
    for beats_long in SPANS:
        for start in range(0, last_tick, BEAT):
            end = min(start + BEAT * beats_long, last_tick)
            pitches = np.flatnonzero(sounded[-(-end // BEAT)] - sounded[start // BEAT])
            spans.setdefault(start, {}).setdefault(end, chord_of({int(p) for p in pitches}))
    chords = []
    start = 0
    while start < last_tick:
        end, (label, _) = max(spans[start].items(), key=lambda item: (item[1][1], item[0]))
        chords.append([start, end, label])
        start = end
    return _absorb_none(chords)


def _beats_sounded(notes: list[Note], last_tick: int) -> np.ndarray:
    """[beat b, pitch]: in how many of the beats before b the pitch sounds (up to `last_tick`), so the pitches of
    beats b0 up to b1 are the columns where row b1 differs from row b0."""
    beats = -(-last_tick // BEAT)
    first = np.array([n.start // BEAT for n in notes])
    after = np.array([-(-min(max(n.end, n.start + 1), last_tick) // BEAT) for n in notes])
    pitch = np.array([n.pitch for n in notes])
    changes = np.zeros((beats + 1, 128), np.int32)
    np.add.at(changes, (first, pitch), 1)
    np.add.at(changes, (np.maximum(after, first), pitch), -1)
    sounding = np.cumsum(changes, axis=0)[:-1] > 0
    sounded = np.zeros((beats + 1, 128), np.int32)
    np.cumsum(sounding, axis=0, out=sounded[1:])
    return sounded


def chord_of(pitches: set[int]) -> tuple[str, int]:
    """(label, score) of the chord the sounding `pitches` make."""
    if not pitches:
        return "N:N", 0
    ascending = [p % 12 for p in sorted(pitches)]
    classes = sorted(set(ascending))
    scored = {root: _score(root, classes) for root in classes}
    best = max(score for _, score in scored.values())
    root = next(pc for pc in ascending if scored[pc][1] == best)
    quality, score = scored[root]
    bass = ascending[0]
    label = f"{PITCH_CLASSES[root]}:{quality}"
    return (label if bass == root else f"{label}/{PITCH_CLASSES[bass]}"), score


def _score(root: int, classes: list[int]) -> tuple[str, int]:
    intervals = {(pc - root) % 12 for pc in classes}
    if (3 in intervals) == (4 in intervals):
        return "None", NO_CHORD_SCORE
    if 3 in intervals:
        quality = "dim" if 6 in intervals else "min"
    elif 8 in intervals:
        quality = "aug"
    else:
        quality = "dom" if 7 in intervals and 10 in intervals else "maj"
    made, plus_one, minus_one, minus_two = QUALITIES[quality]
    score = 0
    for interval in intervals - set(made):
        if interval in minus_one:
            score -= 1
        elif interval in minus_two:
            score -= 2
        elif interval in plus_one:
            score += 1
    return quality, score


def _absorb_none(chords: list[list]) -> list[tuple[int, int, str]]:
    while ":None" in chords[0][2]:
        if len(chords) == 1:
            return []
        chords[1][0] = chords[0][0]
        del chords[0]
    kept: list[list] = []
    for chord in chords:
        if ":None" in chord[2]:
            kept[-1][1] = chord[1]
        else:
            kept.append(chord)
    return [tuple(chord) for chord in kept]
