"""Events to MIDI: the ticks, bins and markers each project's writer gives (YatingMusic/remi utils.py `write_midi`,
compound-word-transformer's remi-xl `wrtie_midi`), checked on the written file as mido reads it back."""

from __future__ import annotations

import io

import mido
import pytest
from helpers.midi import meta_of, notes_of, timeline
from hypothesis import given, settings
from hypothesis import strategies as st

from txl_deploy.errors import InputError, OutputExistsError
from txl_deploy.music.events_to_midi import events_to_midi, events_to_score, write_midi
from txl_deploy.music.representation import REMI_XL

REMI_SONG = [
    "Bar_None",  # the first event opens bar 0, it does not move on a bar
    "Position_1/16", "Tempo Class_mid", "Tempo Value_30",  # 120 bpm at tick 0
    "Position_1/16", "Chord_C:maj",
    "Position_1/16", "Note Velocity_20", "Note On_60", "Note Duration_7",  # velocity 80, 480 ticks
    "Position_5/16", "Note Velocity_31", "Note On_64", "Note Duration_0",  # tick 480, velocity 124, 60 ticks
    "Position_9/16", "Note Velocity_10", "Note On_67",  # no duration: dropped
    "Position_9/16", "Tempo Class_fast", "Tempo Value_10",  # 160 bpm at tick 960
    "Note On_50",  # outside any group: nothing
    "Position_13/16", "Note Velocity_1", "Note On_72", "Note Duration_63",  # tick 1440, velocity 4, 3840 ticks
    "Bar_None",  # bar 1 (tick 1920) stays empty
    "Bar_None",  # bar 2 (tick 3840)
    "Position_3/16", "Chord_A:min",  # tick 4080
    "Position_3/16", "Note Velocity_16", "Note On_57", "Note Duration_15",  # velocity 64, 960 ticks
    "Position_16/16", "Tempo Class_slow", "Tempo Value_0",  # 30 bpm at 3840 + 1800
    "Position_16/16", "Chord_G:dom",  # among the last three events: never read, as upstream
]


def _saved(midi) -> mido.MidiFile:
    """The file as a reader sees it after saving."""
    data = io.BytesIO()
    midi.save(file=data)
    data.seek(0)
    return mido.MidiFile(file=data)


def test_remi_events_become_the_ticks_bins_and_markers_of_its_writer():
    midi = _saved(events_to_midi(REMI_SONG, "remi"))
    assert midi.ticks_per_beat == 480
    assert notes_of(midi) == [(0, 480, 60, 80), (480, 540, 64, 124), (1440, 5280, 72, 4), (4080, 5040, 57, 64)]
    assert meta_of(midi, "set_tempo") == [(0, 120), (960, 160), (5640, 30)]
    assert meta_of(midi, "marker") == [(0, "C:maj"), (4080, "A:min")]
    signatures = [(t, m.numerator, m.denominator) for t, m in timeline(midi)[0] if m.type == "time_signature"]
    assert signatures == [(0, 4, 4)]


def test_remi_without_a_tempo_plays_at_120_and_the_first_bar_may_be_implicit():
    events = ["Position_1/16", "Note Velocity_1", "Note On_60", "Note Duration_0",
              "Bar_None", "Position_1/16", "Note Velocity_1", "Note On_62", "Note Duration_1"]
    midi = _saved(events_to_midi(events, "remi"))
    assert notes_of(midi) == [(0, 60, 60, 4), (1920, 2040, 62, 4)]
    assert meta_of(midi, "set_tempo") == [(0, 120)]


def test_remi_a_tempo_change_in_the_last_three_events_is_not_written():
    events = ["Bar_None", "Position_1/16", "Tempo Class_fast", "Tempo Value_50"]
    assert events_to_score(events, "remi").tempos == []
    assert meta_of(_saved(events_to_midi(events, "remi")), "set_tempo") == [(0, 120)]


REMI_XL_SONG = [
    "Note_Pitch_40", "Note_Velocity_50", "Note_Duration_240",  # before any bar or beat: tick 0
    "Bar_None",  # every bar counts: the first starts at tick 1920
    "Beat_0", "Tempo_110", "Chord_C_M",
    "Note_Pitch_60", "Note_Velocity_90", "Note_Duration_480",
    "Beat_4", "Note_Pitch_64", "Note_Velocity_70", "Note_Duration_0",  # a duration of 0 sounds 60 ticks
    "Note_Pitch_67", "Note_Velocity_70",  # no duration: dropped
    "Beat_8", "Note_Pitch_69", "Note_Velocity_71", "Note_Duration_120",
    "Bar_None", "Bar_None",  # bar 2 stays empty
    "Note_Pitch_70", "Note_Velocity_60", "Note_Duration_120",  # no beat since the bars: the last time, 2880
    "Beat_2", "Chord_A_m", "Tempo_90", "Note_Pitch_57", "Note_Velocity_80", "Note_Duration_1920",  # 3 * 1920 + 240
    "Bar_None", "EOS_None",
    "Beat_0", "Note_Pitch_30", "Note_Velocity_30", "Note_Duration_120", "Bar_None",  # after the end: not placed
]


def test_remi_xl_events_become_the_ticks_and_markers_of_its_writer():
    midi = _saved(events_to_midi(REMI_XL_SONG, REMI_XL))
    assert midi.ticks_per_beat == 480
    assert notes_of(midi) == [(0, 240, 40, 50), (1920, 2400, 60, 90), (2400, 2460, 64, 70), (2880, 3000, 69, 71),
                              (2880, 3000, 70, 60), (6000, 7920, 57, 80)]
    tempos = meta_of(midi, "set_tempo")
    assert [t for t, _ in tempos] == [0, 1920, 6000]  # 120 bpm at tick 0 where the events set none
    assert [bpm for _, bpm in tempos] == pytest.approx([120, 110, 90], rel=1e-5)  # microseconds a beat, rounded
    assert meta_of(midi, "marker") == [(1920, "C_M"), (6000, "A_m")]
    names = [m.name for _, m in timeline(midi)[1] if m.type == "track_name"]
    assert names == ["piano"]


def test_remi_xl_a_note_among_the_last_three_events_is_not_placed_without_an_end():
    """Upstream reads each event with the ones after it and stops three before the end; generated pieces end
    with `EOS_None`, so their last note is placed."""
    tail = ["Bar_None", "Beat_0", "Note_Pitch_60", "Note_Velocity_60", "Note_Duration_120"]
    assert events_to_score(tail, "remi-xl").notes == []
    placed = events_to_score(tail + ["EOS_None"], "remi-xl").notes
    assert [(n.start, n.end, n.pitch, n.velocity) for n in placed] == [(1920, 2040, 60, 60)]


def test_special_symbols_are_skipped():
    with_specials = ["<s>", *REMI_SONG[:10], "<pad>"]
    assert events_to_score(with_specials, "remi") == events_to_score(REMI_SONG[:10], "remi")


@pytest.mark.parametrize("representation, symbol", [
    ("remi", "Note On_128"), ("remi", "Position_0/16"), ("remi", "Position_17/16"), ("remi", "Position_3/8"),
    ("remi", "Note Velocity_32"), ("remi", "Note Duration_64"), ("remi", "Tempo Class_presto"),
    ("remi", "Tempo Value_60"), ("remi", "Chord_"), ("remi", "Note_Pitch_60"), ("remi", "Foo_1"), ("remi", "Bar"),
    ("remi-xl", "Beat_16"), ("remi-xl", "Chord_C"), ("remi-xl", "Tempo_0"), ("remi-xl", "Note_Velocity_128"),
    ("remi-xl", "Note On_60"), ("remi-xl", "Note_Pitch_-1"), ("remi-xl", "EOS_1"),
])
def test_an_event_outside_the_representation_is_a_one_line_error(representation, symbol):
    with pytest.raises(InputError) as caught:
        events_to_midi(["Bar_None", symbol, "Bar_None"], representation)
    message = str(caught.value)
    assert "\n" not in message and "event 1" in message and repr(symbol) in message


def test_a_list_of_something_else_is_a_one_line_error():
    with pytest.raises(InputError, match="event 0"):
        events_to_midi([60], "remi")
    with pytest.raises(InputError, match="unknown music representation"):
        events_to_midi([], "cp")


def test_written_atomically_and_never_over_a_file_without_force(tmp_path):
    out = tmp_path / "song.mid"
    score = write_midi(REMI_SONG, "remi", out)
    assert len(score.notes) == 4
    assert notes_of(mido.MidiFile(filename=str(out)))[0] == (0, 480, 60, 80)
    out.write_bytes(b"mine")
    with pytest.raises(OutputExistsError):
        write_midi(REMI_SONG, "remi", out)
    assert out.read_bytes() == b"mine"
    write_midi(REMI_SONG[:10], "remi", out, force=True)
    assert len(notes_of(mido.MidiFile(filename=str(out)))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["song.mid"]


REMI_POOL = (["Bar_None"] + [f"Position_{k}/16" for k in (1, 2, 9, 16)] + ["Note Velocity_0", "Note Velocity_31"]
             + ["Note On_0", "Note On_60", "Note On_127", "Note Duration_0", "Note Duration_63", "Chord_C:maj",
                "Chord_N:N", "Tempo Class_slow", "Tempo Class_fast", "Tempo Value_0", "Tempo Value_59", "<pad>"])
REMI_XL_POOL = (["Bar_None", "EOS_None", "Beat_0", "Beat_15", "Note_Pitch_0", "Note_Pitch_127", "Note_Velocity_0",
                 "Note_Velocity_127", "Note_Duration_0", "Note_Duration_3840", "Chord_C_M", "Tempo_4", "Tempo_1000"])


@settings(max_examples=150, deadline=None)
@given(data=st.data(), remi=st.booleans())
def test_any_sequence_of_events_is_written_and_reads_back(data, remi):
    """Arbitrary orders of valid events (incomplete groups, stray values, empty bars, events after the end) are
    placed as the writer places them, never refused: the file saves and reads back with the placed notes."""
    pool, name = (REMI_POOL, "remi") if remi else (REMI_XL_POOL, "remi-xl")
    events = data.draw(st.lists(st.sampled_from(pool), max_size=80))
    score = events_to_score(events, name)
    midi = _saved(events_to_midi(events, name))
    onsets = sorted((t, m.note, m.velocity) for t, m in timeline(midi)[1] if m.type == "note_on" and m.velocity)
    assert onsets == sorted((n.start, n.pitch, n.velocity) for n in score.notes if n.velocity)
    assert all(n.end > n.start >= 0 for n in score.notes)
    if remi:
        assert all(n.start % 120 == 0 and (n.end - n.start) % 60 == 0 for n in score.notes)


@settings(max_examples=60, deadline=None)
@given(events=st.lists(st.one_of(st.sampled_from(REMI_POOL + REMI_XL_POOL), st.text(max_size=12)), max_size=30),
       name=st.sampled_from(["remi", "remi-xl"]))
def test_any_list_of_strings_is_written_or_refused_in_one_line(events, name):
    try:
        _saved(events_to_midi(events, name))
    except InputError as e:
        assert "\n" not in str(e)
