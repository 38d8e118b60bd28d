"""`txl-deploy midi`: the representation from the model's vocabulary, both directions, and one-line errors."""

from __future__ import annotations

import sys

import mido
import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.midi import build_midi, notes_of
from helpers.paths import ROOT
from helpers.tiny import make_tiny_model

from txl_deploy.checkpoints.native import save_checkpoint
from txl_deploy.music.midi_to_events import midi_to_events
from txl_deploy.vocab.table import Vocab

REMI_SYMBOLS = (["Bar_None"] + [f"Position_{k}/16" for k in range(1, 17)] + [f"Note On_{p}" for p in range(128)]
                + [f"Note Velocity_{v}" for v in range(32)] + [f"Note Duration_{d}" for d in range(64)]
                + ["Chord_C:maj", "Chord_A:min", "Tempo Class_slow", "Tempo Class_mid", "Tempo Class_fast"]
                + [f"Tempo Value_{n}" for n in range(60)])
REMI_XL_SYMBOLS = (["Bar_None", "EOS_None"] + [f"Beat_{b}" for b in range(16)] + ["Chord_C_M", "Tempo_120"]
                   + [f"Note_Pitch_{p}" for p in range(128)] + [f"Note_Velocity_{v}" for v in range(128)]
                   + [f"Note_Duration_{120 * k}" for k in range(1, 33)])


def _checkpoint(folder, symbols):
    # a word vocabulary holds the symbols verbatim; what matters here is that they come from the model
    model = make_tiny_model(n_token=len(symbols), cutoffs=[], div_val=1, tie_projs=[False])
    return save_checkpoint(folder, model, Vocab(symbols, kind="word"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"remi": _checkpoint(root / "REMI-tempo-checkpoint", REMI_SYMBOLS),
            "remi-chord": _checkpoint(root / "REMI-tempo-chord-checkpoint", REMI_SYMBOLS),
            "remi-xl": _checkpoint(root / "remi-xl", REMI_XL_SYMBOLS),
            "words": _checkpoint(root / "words", [f"w{i}" for i in range(30)])}


def test_events_file_to_midi_for_each_representation(models, tmp_path):
    remi = tmp_path / "remi.txt"
    remi.write_text("Bar_None\nPosition_1/16\nTempo Class_mid\nTempo Value_30\n\n"
                    "Position_5/16\nNote Velocity_20\nNote On_60\nNote Duration_7\nBar_None\n")
    result = cli("midi", models["remi"], remi, "-o", tmp_path / "remi.mid")
    assert result.exit_code == 0, result.output
    assert "1 notes" in result.output and "(remi)" in result.output
    assert notes_of(mido.MidiFile(filename=str(tmp_path / "remi.mid"))) == [(480, 960, 60, 80)]

    remi_xl = tmp_path / "xl.txt"
    remi_xl.write_text("Bar_None\nBeat_4\nNote_Pitch_60\nNote_Velocity_90\nNote_Duration_240\nEOS_None\n")
    result = cli("midi", models["remi-xl"], remi_xl, "-o", tmp_path / "xl.mid")
    assert result.exit_code == 0, result.output
    assert notes_of(mido.MidiFile(filename=str(tmp_path / "xl.mid"))) == [(2400, 2640, 60, 90)]


def test_midi_to_an_events_file_one_event_a_line(models, tmp_path):
    song = build_midi(tmp_path / "song.MID", notes=[(0, 1920, 60, 64), (0, 1920, 64, 64), (0, 1920, 67, 64),
                                                    (1920, 2400, 62, 70)])
    out = tmp_path / "events.txt"
    result = cli("midi", models["remi"], song, "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_text().splitlines() == midi_to_events(song)
    assert "Note On_60" in out.read_text().splitlines()  # kept whole, space included

    # the chord model (its folder's name says so, as upstream decides) gets chord events, unless told otherwise
    result = cli("midi", models["remi-chord"], song, "-o", tmp_path / "chords.txt")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "chords.txt").read_text().splitlines() == midi_to_events(song, chords=True)
    assert "Chord_C:maj" in (tmp_path / "chords.txt").read_text().splitlines()
    result = cli("midi", models["remi-chord"], song, "-o", tmp_path / "plain.txt", "--no-chords")
    assert (tmp_path / "plain.txt").read_text().splitlines() == midi_to_events(song)


def test_the_representation_comes_from_the_vocabulary_or_the_option(models, tmp_path):
    events = tmp_path / "e.txt"
    events.write_text("Bar_None\nBeat_0\nNote_Pitch_60\nNote_Velocity_90\nNote_Duration_240\nEOS_None\n")
    assert_one_line_error(cli("midi", models["words"], events, "-o", tmp_path / "a.mid"),
                          "not one of music events", "--representation")
    result = cli("midi", models["words"], events, "-o", tmp_path / "a.mid", "--representation", "remi-xl")
    assert result.exit_code == 0, result.output
    # remi-xl events read as REMI: not its events
    assert_one_line_error(cli("midi", models["remi"], events, "-o", tmp_path / "b.mid"), "Beat_0", "remi event")


def test_nothing_is_overwritten_without_force(models, tmp_path):
    events = tmp_path / "e.txt"
    events.write_text("Bar_None\n")
    out = tmp_path / "out.mid"
    out.write_bytes(b"mine")
    assert_one_line_error(cli("midi", models["remi"], events, "-o", out), "already exists")
    assert out.read_bytes() == b"mine"
    assert cli("midi", models["remi"], events, "-o", out, "--force").exit_code == 0
    assert mido.MidiFile(filename=str(out)).ticks_per_beat == 480


def test_bad_inputs_are_one_line_errors(models, tmp_path):
    (tmp_path / "bad.mid").write_bytes(b"MThd\x00\x00\x00\x06\x00\x01\x00\x02\x01\xe0MTrk\x00\x00\x01")
    assert_one_line_error(cli("midi", models["remi"], tmp_path / "bad.mid", "-o", tmp_path / "x.txt"),
                          "not a readable MIDI file")
    (tmp_path / "latin.txt").write_bytes(b"Bar_None\n\xff\n")
    assert_one_line_error(cli("midi", models["remi"], tmp_path / "latin.txt", "-o", tmp_path / "x.mid"),
                          "not UTF-8")
    song = build_midi(tmp_path / "s.mid", notes=[(0, 480, 60, 64)])
    assert_one_line_error(cli("midi", models["remi-xl"], song, "-o", tmp_path / "x.txt"), "remi only")
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "x.mid").exists()


def test_help_says_both_directions():
    result = cli("midi", "--help")
    assert result.exit_code == 0
    for words in ("MIDI file", ".mid", "--representation", "--chords", "--force", "remi-xl"):
        assert words in result.output


def test_without_mido_the_music_extra_is_named(monkeypatch, models, tmp_path):
    monkeypatch.setitem(sys.modules, "mido", None)  # as if the music extra were not installed
    monkeypatch.chdir(ROOT)
    events = tmp_path / "e.txt"
    events.write_text("Bar_None\n")
    assert_one_line_error(cli("midi", models["remi"], events, "-o", tmp_path / "x.mid"), "mido is not installed",
                          "pip install -e '.[music]'")


def test_an_exported_models_vocabulary_is_read_from_its_metadata(tiny_onnx, tmp_path):
    events = tmp_path / "e.txt"
    events.write_text("Bar_None\n")
    assert_one_line_error(cli("midi", tiny_onnx, events, "-o", tmp_path / "a.mid"), str(tiny_onnx),
                          "not one of music events")
