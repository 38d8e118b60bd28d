"""MIDI to REMI events, as the Pop Music Transformer's `extract_events` gives them (YatingMusic/remi utils.py):
files built here with mido, events checked exactly; the chord recogniser's rules; bad files."""

from __future__ import annotations

import mido
import pytest
from helpers.midi import build_midi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl_deploy.errors import InputError
from txl_deploy.music.chords import chord_of, recognise_chords
from txl_deploy.music.events_to_midi import write_midi
from txl_deploy.music.midi_file import Note, read_midi
from txl_deploy.music.midi_to_events import midi_to_events


def _note(position: str, velocity: int, pitch: int, duration: int) -> list[str]:
    return [f"Position_{position}", f"Note Velocity_{velocity}", f"Note On_{pitch}", f"Note Duration_{duration}"]


def test_notes_move_to_the_16th_grid_and_their_values_to_the_bins(tmp_path):
    path = build_midi(tmp_path / "a.mid", tempos=[(0, 100)], notes=[
        (130, 600, 60, 81),  # 10 ticks after 120: there; 470 ticks is nearest 480 (bin 7); velocity 81 // 4
        (180, 300, 64, 90),  # halfway between 120 and 240: the earlier; 120 ticks (bin 1)
        (1000, 1200, 67, 127),  # nearest 960 (position 9); 200 ticks is nearest 180 (bin 2)
        (4080, 4560, 72, 50),  # the last note: upstream's grid stops before it, so it moves to 3960
    ])
    assert midi_to_events(path) == [
        "Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_10",
        *_note("2/16", 20, 60, 7), *_note("2/16", 22, 64, 1), *_note("9/16", 31, 67, 2),
        # bar 1 holds no note: left out
        "Bar_None", *_note("2/16", 12, 72, 7),
    ]


def test_tempo_is_read_on_every_beat_up_to_the_last_change(tmp_path):
    path = build_midi(tmp_path / "t.mid", tempos=[(0, 100), (960, 160), (1500, 70), (1920, 200)],
                      notes=[(0, 480, 60, 64), (3840, 4320, 62, 64)])
    assert midi_to_events(path) == [
        "Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_10", *_note("1/16", 16, 60, 7),
        "Position_5/16", "Tempo Class_mid", "Tempo Value_10",
        "Position_9/16", "Tempo Class_fast", "Tempo Value_10",
        "Position_13/16", "Tempo Class_fast", "Tempo Value_10",  # 70 bpm at tick 1500 falls between beats: unseen
        "Bar_None", "Position_1/16", "Tempo Class_fast", "Tempo Value_50", *_note("16/16", 16, 62, 7),
    ]


@pytest.mark.parametrize("bpm, tempo_class, value", [
    (20, "slow", 0), (30, "slow", 0), (89, "slow", 59), (100, "mid", 10),
    # a whole bpm is stored as microseconds a beat, rounded: 90 reads back as 89.99996, 97 as 96.99995, and
    # upstream cuts them down (int) to 89 and 96
    (90, "slow", 59), (97, "mid", 6),
    (150, "fast", 0), (209, "fast", 59), (210, "fast", 59), (250, "fast", 59),
])
def test_tempo_classes_and_values(tmp_path, bpm, tempo_class, value):
    path = build_midi(tmp_path / "c.mid", tempos=[(0, bpm)], notes=[(0, 240, 60, 100)])
    assert midi_to_events(path) == ["Bar_None", "Position_1/16", f"Tempo Class_{tempo_class}",
                                    f"Tempo Value_{value}", *_note("1/16", 25, 60, 3)]


def test_at_exactly_210_bpm_the_tempo_before_is_repeated(tmp_path):
    """Upstream's classes leave 210 bpm out (fast stops below it, its clamp starts above): it writes the previous
    tempo's events again; as the first tempo, where upstream fails, it is the fastest value."""
    path = build_midi(tmp_path / "210.mid", tempos=[(0, 100), (480, 210)], notes=[(0, 960, 60, 64)])
    assert midi_to_events(path)[:10] == [
        "Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_10", *_note("1/16", 16, 60, 15),
        "Position_5/16", "Tempo Class_mid"]


def test_notes_are_paired_as_the_projects_midi_reader_pairs_them(tmp_path):
    """miditoolkit 0.1.x (pretty_midi's rule): a note-off closes every earlier note of its pitch; a note-on on the
    note-off's tick stays open if something closed, and a note of no length is lost."""
    def on(tick, pitch, velocity):
        return tick, mido.Message("note_on", note=pitch, velocity=velocity)

    def off(tick, pitch):
        return tick, mido.Message("note_off", note=pitch)

    track = [on(0, 60, 80), on(240, 60, 90), off(480, 60),  # one note-off ends both
             on(960, 62, 70), off(960, 62),  # no length: lost
             on(1440, 64, 60), off(1920, 64), on(1920, 64, 50), off(2400, 64),
             on(2880, 65, 30), on(3360, 65, 40), off(3360, 65), off(3840, 65)]  # the 3360 note outlives the off
    path = build_midi(tmp_path / "p.mid", notes=[], extra_tracks=[track])
    assert sorted((n.start, n.end, n.pitch, n.velocity) for n in read_midi(path).notes) == [
        (0, 480, 60, 80), (240, 480, 60, 90), (1440, 1920, 64, 60), (1920, 2400, 64, 50), (2880, 3360, 65, 30),
        (3360, 3840, 65, 40)]


def test_another_resolution_is_read_at_480_ticks_a_beat(tmp_path):
    at_96 = build_midi(tmp_path / "96.mid", notes=[(0, 96, 60, 64), (72, 120, 61, 64), (192, 288, 62, 64)],
                       ticks_per_beat=96)
    at_480 = build_midi(tmp_path / "480.mid", notes=[(0, 480, 60, 64), (360, 600, 61, 64), (960, 1440, 62, 64)])
    assert midi_to_events(at_96) == midi_to_events(at_480)


def test_only_the_first_instrument_is_read(tmp_path):
    second = [(0, mido.Message("program_change", channel=1, program=5)),
              (0, mido.Message("note_on", channel=1, note=40, velocity=90)),
              (100, mido.Message("note_off", channel=1, note=40)),
              (200, mido.Message("note_off", channel=1, note=41))]  # a note-off with no note: ignored
    path = build_midi(tmp_path / "i.mid", notes=[(0, 480, 60, 64), (480, 960, 62, 64)], extra_tracks=[second])
    events = midi_to_events(path)
    assert [e for e in events if e.startswith("Note On")] == ["Note On_60", "Note On_62"]


def test_notes_that_all_start_together_stay_there(tmp_path):
    """Upstream's grid is empty when every note starts at tick 0 (it fails there); they stay on position 1."""
    path = build_midi(tmp_path / "z.mid", notes=[(0, 480, 60, 64), (0, 480, 64, 64)])
    assert midi_to_events(path) == ["Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_30",
                                    *_note("1/16", 16, 60, 7), *_note("1/16", 16, 64, 7)]


def test_chords_come_with_their_position(tmp_path):
    path = build_midi(tmp_path / "ch.mid", notes=[
        (0, 1920, 60, 64), (0, 1920, 64, 64), (0, 1920, 67, 64),  # C E G
        (1920, 3840, 57, 64), (1920, 3840, 60, 64), (1920, 3840, 64, 64),  # A C E
        (3840, 4320, 72, 64),  # the last note, moved to 3720
    ])
    assert midi_to_events(path, chords=True) == [
        "Bar_None", "Position_1/16", "Chord_C:maj", "Position_1/16", "Tempo Class_mid", "Tempo Value_30",
        *_note("1/16", 16, 60, 31), *_note("1/16", 16, 64, 31), *_note("1/16", 16, 67, 31),
        "Bar_None", "Position_1/16", "Chord_A:min",
        *_note("1/16", 16, 57, 31), *_note("1/16", 16, 60, 31), *_note("1/16", 16, 64, 31),
        *_note("16/16", 16, 72, 7),
    ]
    assert "Chord_C:maj" not in midi_to_events(path)


@pytest.mark.parametrize("pitches, chord", [
    ({60, 64, 67}, ("C:maj", 1)),  # the fifth scores +1
    ({64, 67, 72}, ("C:maj/E", 1)),  # first inversion: the bass is named
    ({57, 60, 64}, ("A:min", 1)),
    ({60, 64, 67, 70}, ("C:dom", 0)),
    ({59, 62, 65}, ("B:dim", 0)),
    ({60, 64, 68}, ("C:aug", 0)),  # every root scores the same: the lowest sounding note wins
    ({64, 68, 72}, ("E:aug", 0)),
    ({60, 62, 64, 67}, ("C:maj", 0)),  # the ninth: -1
    ({60, 63, 64}, ("C:None", -100)),  # both thirds: no chord
    (set(), ("N:N", 0)),
])
def test_the_recogniser_rules(pitches, chord):
    assert chord_of(pitches) == chord


def test_spans_take_the_best_score_and_the_longer_and_absorb_no_chord():
    def notes(start, end, *pitches):
        return [Note(start, end, p, 64) for p in pitches]

    # a lone C (no chord) first: absorbed by the C major after it
    assert recognise_chords(notes(0, 1920, 60) + notes(1920, 3840, 60, 64, 67)) == [(0, 3840, "C:maj")]
    # four beats of C major, then two of A minor and two of G major: the two-beat spans score better than the
    # four beats of both (best -1, A minor over G)
    song = notes(0, 1920, 60, 64, 67) + notes(1920, 2880, 57, 60, 64) + notes(2880, 3840, 55, 59, 62)
    assert recognise_chords(song) == [(0, 1920, "C:maj"), (1920, 2880, "A:min"), (2880, 3840, "G:maj")]
    assert chord_of({57, 60, 64, 55, 59, 62}) == ("A:min/G", -1)
    assert recognise_chords(notes(0, 480, 60)) == []  # no chord anywhere


def test_events_to_midi_and_back(tmp_path):
    """A REMI list on the grid, as upstream extracts one, comes back the same, but for its last note: upstream's
    grid stops before the last onset, so that note moves a 16th earlier (as it does for upstream's own data)."""
    events = ["Bar_None", "Position_1/16", "Tempo Class_mid", "Tempo Value_30",
              *_note("1/16", 20, 60, 3), *_note("1/16", 20, 64, 3), *_note("7/16", 25, 67, 1),
              "Bar_None", *_note("3/16", 10, 48, 15), *_note("11/16", 18, 72, 7)]
    write_midi(events, "remi", tmp_path / "r.mid")
    assert midi_to_events(tmp_path / "r.mid") == events[:-4] + _note("10/16", 18, 72, 7)


def test_remi_xl_has_no_extractor():
    with pytest.raises(InputError, match="remi only"):
        midi_to_events("any.mid", "remi-xl")


def _check(path):
    try:
        events = midi_to_events(path, chords=True)
    except InputError as e:
        assert "\n" not in str(e) and str(path) in str(e)
        return None
    assert all(isinstance(e, str) for e in events)
    return events


def test_not_midi_or_without_notes_is_a_one_line_error(tmp_path):
    (tmp_path / "empty.mid").write_bytes(b"")
    (tmp_path / "text.mid").write_text("Bar_None\n")
    build_midi(tmp_path / "silent.mid", notes=[], tempos=[(0, 90)])
    for name, fragment in [("empty.mid", "not a readable MIDI"), ("text.mid", "not a readable MIDI"),
                           ("silent.mid", "holds no notes"), ("missing.mid", "cannot read"),
                           (".", "cannot read")]:
        with pytest.raises(InputError, match=fragment) as caught:
            midi_to_events(tmp_path / name)
        assert "\n" not in str(caught.value)


def test_a_key_signature_mido_cannot_decode_is_a_one_line_error(tmp_path):
    """mido raises its own KeySignatureError (not a ValueError) for a key with 8 sharps; the fuzzer found it."""
    track = b"\x00\xff\x59\x02\x08\x52\x00\xff\x2f\x00"  # key signature: 8 sharps, mode 82; end of track
    (tmp_path / "key.mid").write_bytes(b"MThd\x00\x00\x00\x06\x00\x00\x00\x01\x01\xe0MTrk"
                                       + len(track).to_bytes(4, "big") + track)
    with pytest.raises(InputError, match="not a readable MIDI file"):
        midi_to_events(tmp_path / "key.mid")


def test_a_tempo_of_zero_is_a_one_line_error(tmp_path):
    """set_tempo 0 (microseconds a beat) made mido's tempo2bpm divide by zero; the fuzzer found it."""
    track = (b"\x00\xff\x51\x03\x00\x00\x00"  # set_tempo 0
             b"\x00\x90\x3c\x40\x83\x60\x80\x3c\x40\x00\xff\x2f\x00")  # a note on and off; end of track
    (tmp_path / "tempo.mid").write_bytes(b"MThd\x00\x00\x00\x06\x00\x00\x00\x01\x01\xe0MTrk"
                                         + len(track).to_bytes(4, "big") + track)
    with pytest.raises(InputError, match="tempo of 0 microseconds per beat"):
        midi_to_events(tmp_path / "tempo.mid")


def test_files_too_large_or_too_long_are_refused_before_they_are_laid_out(tmp_path):
    (tmp_path / "big.mid").write_bytes(b"MThd" + bytes(4 << 20))
    with pytest.raises(InputError, match="too large for a MIDI file"):
        midi_to_events(tmp_path / "big.mid")
    long = build_midi(tmp_path / "long.mid", notes=[(0, 480, 60, 64), (480, 20_001 * 480, 62, 64)])
    with pytest.raises(InputError, match="spans 20,001 beats"):
        midi_to_events(long, chords=True)


@pytest.fixture(scope="module")
def song_bytes(tmp_path_factory):
    path = build_midi(tmp_path_factory.mktemp("song") / "s.mid", tempos=[(0, 100), (1920, 130)], notes=[
        (i * 240, i * 240 + 300, 48 + i % 24, 40 + i) for i in range(40)])
    return path.read_bytes()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(0, 10_000), flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
                                                     max_size=6))
def test_truncated_or_damaged_files_are_read_or_refused_in_one_line(tmp_path, song_bytes, cut, flips):
    data = bytearray(song_bytes[:cut % (len(song_bytes) + 1)])
    for at, value in flips:
        if data:
            data[at % len(data)] = value
    path = tmp_path / "fuzz.mid"
    path.write_bytes(bytes(data))
    _check(path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=200))
def test_arbitrary_bytes_after_a_midi_header_are_refused_in_one_line(tmp_path, data):
    path = tmp_path / "junk.mid"
    path.write_bytes(b"MThd\x00\x00\x00\x06\x00\x01\x00\x02\x01\xe0MTrk" + data)
    _check(path)
