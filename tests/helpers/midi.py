"""MIDI files for the music tests, built and read with mido itself (not through the code under test)."""

from __future__ import annotations

from pathlib import Path

import mido


def timeline(midi) -> list[list[tuple[int, object]]]:
    """Each track of a `mido.MidiFile` as (absolute tick, message) pairs."""
    tracks = []
    for track in midi.tracks:
        now, events = 0, []
        for message in track:
            now += message.time
            events.append((now, message))
        tracks.append(events)
    return tracks


def notes_of(midi) -> list[tuple[int, int, int, int]]:
    """(start, end, pitch, velocity) of every note, paired as note-on then the next velocity-0 note-on of its pitch."""
    notes, sounding = [], {}
    for track in timeline(midi):
        for tick, m in track:
            if m.type == "note_on" and m.velocity > 0:
                sounding.setdefault(m.note, []).append((tick, m.velocity))
            elif m.type in ("note_on", "note_off") and sounding.get(m.note):
                start, velocity = sounding[m.note].pop(0)
                notes.append((start, tick, m.note, velocity))
    return sorted(notes)


def meta_of(midi, kind: str) -> list[tuple[int, object]]:
    """(tick, value) of the meta events of `kind` ("set_tempo": bpm as mido computes it; "marker": text)."""
    out = []
    for track in timeline(midi):
        for tick, m in track:
            if m.type == kind == "set_tempo":
                out.append((tick, round(mido.tempo2bpm(m.tempo), 6)))
            elif m.type == kind == "marker":
                out.append((tick, m.text))
    return out


def build_midi(path: Path, notes, tempos=(), ticks_per_beat=480, extra_tracks=()) -> Path:
    """Write a type-1 file: a tempo track with `tempos` (tick, bpm), a track with `notes` (start, end, pitch, velocity)
    as note_on / note_off pairs, then `extra_tracks` (lists of (tick, message))."""
    def track(events):
        t, now = mido.MidiTrack(), 0
        for tick, message in sorted(events, key=lambda e: e[0]):
            t.append(message.copy(time=tick - now))
            now = tick
        return t

    midi = mido.MidiFile(type=1, ticks_per_beat=ticks_per_beat)
    midi.tracks.append(track([(tick, mido.MetaMessage("set_tempo", tempo=mido.bpm2tempo(bpm)))
                              for tick, bpm in tempos]))
    events = []
    for start, end, pitch, velocity in notes:
        events.append((start, mido.Message("note_on", note=pitch, velocity=velocity)))
        events.append((end, mido.Message("note_off", note=pitch, velocity=0)))
    midi.tracks.append(track(events))
    for extra in extra_tracks:
        midi.tracks.append(track(extra))
    midi.save(filename=str(path))
    return path
