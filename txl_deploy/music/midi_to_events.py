"""MIDI to REMI events, as the Pop Music Transformer extracts them from a prompt or its training songs.

From YatingMusic/remi (model.py `extract_events`, utils.py `read_items`, `quantize_items`, `group_items`,
`item2event`), in words:
- The notes are those of the file's first instrument. Their starts move to the nearest 16th (120 ticks; a tie goes
  earlier) of a grid that stops before the last note's start, so the last notes move a 16th earlier if they are on
  it; the ends move with the starts.
- The tempo is read on every beat from 0 to the last tempo change: a change on that beat, or the beat before's
  tempo (a change between beats is not seen); bpm as a whole number, cut down.
- Chords (optional, as for the chord model) come from the rule-based recogniser (chords.py) on the moved notes.
- Items are cut into bars of 1920 ticks up to the bar after the last note's end; a bar without a note is left out.
  Each bar gives `Bar_None`, then for each item, in time order (chords, then tempos, then notes at one tick; notes
  at one tick by their original start and pitch), `Position_k/16` and its events: `Note Velocity_v` (v = velocity
  // 4), `Note On_pitch`, `Note Duration_d` (the nearest of 60 (d + 1) ticks; a tie goes shorter); `Chord_X:yy`;
  `Tempo Class_c`, `Tempo Value_n` (slow, mid, fast from 30, 90, 150 bpm; slower is slow 0, faster than 210 fast
  59; exactly 210 repeats the tempo before, as upstream's classes leave it out).
Upstream assumes 480 ticks a beat; a file at another resolution is rescaled to it first (a 480 file is untouched).
"""

from __future__ import annotations

from bisect import bisect_right

from txl_deploy.errors import InputError
from txl_deploy.music.chords import recognise_chords
from txl_deploy.music.events_to_midi import (
    DURATION_BINS,
    DURATION_STEP,
    POSITIONS,
    TEMPO_CLASS_START,
    TEMPO_VALUES,
    TICKS_PER_BAR,
    TICKS_PER_POSITION,
    VELOCITY_STEP,
    as_representation,
)
from txl_deploy.music.midi_file import TICKS_PER_BEAT, Note, read_midi
from txl_deploy.music.representation import REMI

MAX_BEATS = 20_000  # about 2.8 hours at 120 bpm: longer spans are refused before anything is laid out per beat
_TEMPO_STARTS = sorted(TEMPO_CLASS_START.items(), key=lambda item: item[1])


def midi_to_events(path, representation="remi", chords: bool = False) -> list[str]:
    """The REMI events of the MIDI file at `path`, as the Pop Music Transformer extracts them; `chords`: add the
    chord events (as its chord model's prompts have). A file that is not MIDI, truncated, or without notes: a
    one-line `InputError`."""
    rep = as_representation(representation)
    if rep is not REMI:
        raise InputError(f"MIDI to events is defined for remi only (its project extracts events from MIDI); "
                         f"not for {rep.name}")
    performance = read_midi(path)
    scale = _Rescale(performance.ticks_per_beat)
    notes = sorted((scale.note(n) for n in performance.notes), key=lambda n: (n.start, n.pitch))
    tempos = [(scale(tick), int(bpm)) for tick, bpm in performance.tempos]
    span = max(max(n.end for n in notes), max(tick for tick, _ in tempos))
    if span > MAX_BEATS * TICKS_PER_BEAT:
        raise InputError(f"{path}: spans {span // TICKS_PER_BEAT:,} beats, more than the {MAX_BEATS:,} "
                         "this reads")
    notes = quantize(notes)
    items = []
    if chords:
        items += [(start, "Chord", label.split("/")[0]) for start, _, label in recognise_chords(notes)]
    items += [(tick, "Tempo", bpm) for tick, bpm in tempo_on_beats(tempos)]
    items += [(n.start, "Note", n) for n in notes]
    return items_to_events(items, last_end=notes[-1].end)


class _Rescale:
    """Ticks at the file's resolution to ticks at 480 a beat (rounded)."""

    def __init__(self, ticks_per_beat: int):
        self.ticks_per_beat = ticks_per_beat

    def __call__(self, tick: int) -> int:
        if self.ticks_per_beat == TICKS_PER_BEAT:
            return tick
        return (tick * TICKS_PER_BEAT + self.ticks_per_beat // 2) // self.ticks_per_beat

    def note(self, note: Note) -> Note:
        return Note(self(note.start), self(note.end), note.pitch, note.velocity)


def quantize(notes: list[Note]) -> list[Note]:
    """Each note moved to the 16th nearest its start, on the grid of 16ths before the last note's start (`notes`
    in start order)."""
    last_point = max(-(-notes[-1].start // TICKS_PER_POSITION) - 1, 0)  # upstream's grid: 0 <= tick < last start
    moved = []
    for note in notes:
        below = min(note.start // TICKS_PER_POSITION, last_point)
        point = below
        if below < last_point and (below + 1) * TICKS_PER_POSITION - note.start < note.start - below * \
                TICKS_PER_POSITION:
            point = below + 1
        shift = point * TICKS_PER_POSITION - note.start
        moved.append(Note(note.start + shift, note.end + shift, note.pitch, note.velocity))
    return moved


def tempo_on_beats(tempos: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(tick, bpm) on every beat from 0 to the last change: the change on that beat, or the beat before's."""
    tempos = sorted(tempos, key=lambda change: change[0])
    on_tick = dict(tempos)
    beats = []
    for tick in range(0, tempos[-1][0] + 1, TICKS_PER_BEAT):
        beats.append((tick, on_tick.get(tick, beats[-1][1] if beats else on_tick.get(0))))
    return beats


def items_to_events(items: list[tuple[int, str, object]], last_end: int) -> list[str]:
    """The REMI events of `items` (tick, kind, value) grouped in bars up to the bar after `last_end`."""
    bars = -(-(last_end + TICKS_PER_BAR) // TICKS_PER_BAR) - 1  # upstream's downbeats: 0 <= tick < end + a bar
    by_bar: list[list] = [[] for _ in range(bars)]
    for item in sorted(items, key=lambda item: item[0]):
        bar = item[0] // TICKS_PER_BAR
        if 0 <= bar < bars:
            by_bar[bar].append(item)
    events: list[str] = []
    tempo_events: list[str] = []  # the last tempo's, which upstream repeats for 210 bpm
    for bar, inside in enumerate(by_bar):
        if not any(kind == "Note" for _, kind, _ in inside):
            continue
        events.append("Bar_None")
        for tick, kind, value in inside:
            events.append(f"Position_{_position(tick - bar * TICKS_PER_BAR) + 1}/{POSITIONS}")
            if kind == "Note":
                events += [f"Note Velocity_{value.velocity // VELOCITY_STEP}", f"Note On_{value.pitch}",
                           f"Note Duration_{_duration_bin(value.end - value.start)}"]
            elif kind == "Chord":
                events.append(f"Chord_{value}")
            else:
                tempo_events = _tempo_events(value, tempo_events)
                events += tempo_events
    return events


def _position(offset: int) -> int:
    """The nearest of the bar's 16 positions (a tie goes earlier)."""
    return min(range(POSITIONS), key=lambda k: (abs(k * TICKS_PER_POSITION - offset), k))


def _duration_bin(ticks: int) -> int:
    """The nearest of the 64 durations 60 (d + 1) (a tie goes shorter)."""
    return min(range(DURATION_BINS), key=lambda d: (abs(DURATION_STEP * (d + 1) - ticks), d))


def _tempo_events(bpm: int, previous: list[str]) -> list[str]:
    """`Tempo Class`, `Tempo Value` of `bpm`; `previous`: the events of the tempo before (none: [])."""
    lowest, highest = _TEMPO_STARTS[0], _TEMPO_STARTS[-1]
    top = highest[1] + TEMPO_VALUES
    if bpm == top and previous:
        # upstream's fast class stops below 210 and its clamp starts above it: at exactly 210 it matches nothing and
        # writes the events of the tempo before again (where there is none it fails; the fastest value here)
        return previous
    if bpm < lowest[1]:
        name, value = lowest[0], 0
    elif bpm >= top:
        name, value = highest[0], TEMPO_VALUES - 1
    else:
        starts = [start for _, start in _TEMPO_STARTS]
        name, start = _TEMPO_STARTS[bisect_right(starts, bpm) - 1]
        value = bpm - start
    return [f"Tempo Class_{name}", f"Tempo Value_{value}"]
