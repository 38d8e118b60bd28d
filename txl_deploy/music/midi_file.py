"""MIDI files in and out: a score (notes, tempo changes, markers) written as the music projects' MIDI library lays it
out, and a file's notes and tempo changes read as that library reads them.

Both projects write and read MIDI through miditoolkit; this module follows its rules with `mido` (what miditoolkit
itself builds on), so files and event lists come out as theirs do. From miditoolkit's `MidiFile.dump` and its
parser (github.com/YatingMusic/miditoolkit, the 2020 release the projects used):
- written: a first track of meta events (a 4/4 time signature at tick 0; a 120 bpm tempo at tick 0 unless the score
  sets one there; the tempo changes; the markers), then one track for the instrument (its name, a program change,
  each note as a note-on and a note-on of velocity 0), each track ordered by tick, then by kind, then by pitch, and
  ended one tick after its last event;
- read (miditoolkit 0.1.x, the releases of 2020-2022 the projects' data went through; pretty_midi's rule): a note-off
  (or note-on of velocity 0) closes every note of its channel and pitch that started on an earlier tick; a note-on on
  the note-off's own tick stays open if an earlier note was closed, and is dropped otherwise (so a note of no
  length is lost); notes belong to an instrument per (program, channel, track), in the order the instruments' first
  notes close; tempo changes start as 120 bpm at tick 0, a tempo at tick 0 replaces the list, and a later one is
  kept when it differs from the last kept.
mido is imported late: it comes with the music extra, which `import txl_deploy` does not need.
"""

from __future__ import annotations

import io
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path

TICKS_PER_BEAT = 480  # both projects write at 480 ticks a beat (remi utils.py DEFAULT_RESOLUTION, remi-xl BEAT_RESOL)
DEFAULT_BPM = 120  # the tempo miditoolkit writes at tick 0 when a score has none there, and assumes when reading
# A MIDI file is read whole into Python objects (a few hundred bytes an event); songs are kilobytes, so a larger
# file is refused unread
MAX_MIDI_BYTES = 4 << 20

# miditoolkit's order of the events that share a tick: meta events before channel events, note-offs (velocity 0)
# before note-ons of the same pitch
_KIND_RANK = {"set_tempo": 1, "time_signature": 2, "marker": 4, "program_change": 6, "note_on": 10}


@dataclass(frozen=True)
class Note:
    """A note in ticks: it sounds from `start` up to `end`."""

    start: int
    end: int
    pitch: int
    velocity: int


@dataclass
class Score:
    """What the writers place: notes of one instrument, tempo changes (tick, bpm) and markers (tick, text)."""

    notes: list[Note] = field(default_factory=list)
    tempos: list[tuple[int, float]] = field(default_factory=list)
    markers: list[tuple[int, str]] = field(default_factory=list)
    track_name: str = ""


def score_to_midi(score: Score):
    """`score` as a `mido.MidiFile` at 480 ticks a beat, laid out as miditoolkit writes it."""
    import mido  # the music extra

    meta = [(0, mido.MetaMessage("time_signature", numerator=4, denominator=4))]
    if not any(tick == 0 for tick, _ in score.tempos):
        meta.append((0, mido.MetaMessage("set_tempo", tempo=mido.bpm2tempo(DEFAULT_BPM))))
    meta += [(tick, mido.MetaMessage("set_tempo", tempo=mido.bpm2tempo(bpm))) for tick, bpm in score.tempos]
    meta += [(tick, mido.MetaMessage("marker", text=text)) for tick, text in score.markers]
    meta.sort(key=lambda item: (item[0], _KIND_RANK[item[1].type]))

    head = [(0, mido.MetaMessage("track_name", name=score.track_name))] if score.track_name else []
    notes = [(0, mido.Message("program_change", program=0, channel=0))]
    for note in score.notes:
        notes.append((note.start, mido.Message("note_on", note=note.pitch, velocity=note.velocity, channel=0)))
        notes.append((note.end, mido.Message("note_on", note=note.pitch, velocity=0, channel=0)))
    notes.sort(key=lambda item: (item[0], _rank(item[1])))
    _release_before_strike(notes)

    midi = mido.MidiFile(type=1, ticks_per_beat=TICKS_PER_BEAT)
    for events in (meta, head + notes):
        midi.tracks.append(_track(events, mido))
    return midi


def _rank(message) -> int:
    rank = _KIND_RANK[message.type] << 16
    return rank + (message.note << 8) + message.velocity if message.type == "note_on" else rank


def _release_before_strike(events: list) -> None:
    """A note-off and a note-on of one pitch at one tick: the note-off first (miditoolkit's last pass on a track)."""
    for i in range(len(events) - 1):
        (t1, a), (t2, b) = events[i], events[i + 1]
        if (t1 == t2 and a.type == b.type == "note_on" and a.note == b.note and a.velocity != 0
                and b.velocity == 0):
            events[i], events[i + 1] = events[i + 1], events[i]


def _track(events: list, mido):
    """A track from (absolute tick, message) pairs: delta times, and the end one tick after the last event."""
    track = mido.MidiTrack()
    now = 0
    for tick, message in events:
        track.append(message.copy(time=tick - now))
        now = tick
    track.append(mido.MetaMessage("end_of_track", time=1))
    return track


def save_midi(midi, path, force: bool = False) -> Path:
    """Write `midi` (a `mido.MidiFile`) to `path` atomically; an existing file only with `force`."""
    path = Path(path)
    with atomic_path(path, force=force) as tmp:
        midi.save(filename=str(tmp))
    return path


@dataclass
class Performance:
    """What a MIDI file holds for the event extractor: the first instrument's notes and the tempo changes."""

    notes: list[Note]
    tempos: list[tuple[int, float]]
    ticks_per_beat: int


def read_midi(path) -> Performance:
    """The notes of the file's first instrument and its tempo changes, as miditoolkit reads them; a file that is not
    MIDI, is truncated or holds no notes: a one-line `InputError`."""
    import mido  # the music extra

    path = Path(path)
    try:
        size = os.path.getsize(path)
        if size > MAX_MIDI_BYTES:
            raise InputError(f"{path}: {size:,} bytes is too large for a MIDI file (at most {MAX_MIDI_BYTES:,})")
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        # from memory: mido reads each chunk with the size its header claims, which a file object would allocate
        # whole (gigabytes for a damaged header); a bytes buffer hands back only what the file holds
        midi = mido.MidiFile(file=io.BytesIO(data))
    except (OSError, EOFError, ValueError, KeyError, IndexError, TypeError, mido.KeySignatureError) as e:
        raise InputError(f"{path}: not a readable MIDI file ({_reason(e)})") from None
    if not 0 < midi.ticks_per_beat < 0x8000:  # the top bit would mean SMPTE frames, which have no beats
        raise InputError(f"{path}: its time division ({midi.ticks_per_beat}) is not in ticks per beat")
    tracks = [_absolute(track) for track in midi.tracks]
    notes = _first_instrument_notes(tracks)
    if not notes:
        raise InputError(f"{path}: holds no notes")
    return Performance(notes, _tempo_changes(tracks, mido, path), midi.ticks_per_beat)


def _reason(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text[:120] if text else type(error).__name__


def _absolute(track) -> list[tuple[int, object]]:
    now, events = 0, []
    for message in track:
        now += message.time
        events.append((now, message))
    return events


def _tempo_changes(tracks, mido, path) -> list[tuple[int, float]]:
    changes = [(0, float(DEFAULT_BPM))]
    for track in tracks:
        for tick, message in track:
            if message.type != "set_tempo":
                continue
            if message.tempo == 0:  # 0 microseconds a beat: no tempo (miditoolkit divides by it and fails)
                raise InputError(f"{path}: sets a tempo of 0 microseconds per beat")
            bpm = mido.tempo2bpm(message.tempo)
            if tick == 0:
                changes = [(0, bpm)]
            elif bpm != changes[-1][1]:
                changes.append((tick, bpm))
    return changes


def _first_instrument_notes(tracks) -> list[Note]:
    """The notes of the instrument whose first note closes first (miditoolkit's `instruments[0]`)."""
    first = None
    notes: list[Note] = []
    for index, track in enumerate(tracks):
        program = [0] * 16
        open_notes: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
        for tick, message in track:
            if message.type == "program_change":
                program[message.channel] = message.program
            elif message.type == "note_on" and message.velocity > 0:
                open_notes[message.channel, message.note].append((tick, message.velocity))
            elif message.type in ("note_off", "note_on"):
                key = (message.channel, message.note)
                if key not in open_notes:
                    continue  # a note-off with no note sounding
                closed = [(start, velocity) for start, velocity in open_notes[key] if start != tick]
                kept = [(start, velocity) for start, velocity in open_notes[key] if start == tick]
                for start, velocity in closed:
                    instrument = (program[message.channel], message.channel, index)
                    if first is None:
                        first = instrument
                    if instrument == first:
                        notes.append(Note(start, tick, message.note, velocity))
                if closed and kept:
                    open_notes[key] = kept
                else:
                    del open_notes[key]
    return notes
