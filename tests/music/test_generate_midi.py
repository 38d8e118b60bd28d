"""`txl-deploy generate --midi` and `generate_music`: a tiny model whose vocabulary is music events writes a song
as MIDI, events and a piano roll; bars, seeds, priming, prompts and the grammar behave as users rely on."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.event_models import SYMBOLS, save_event_model

from txl_deploy.errors import InputError
from txl_deploy.music import generate_music
from txl_deploy.music.events_to_midi import events_to_score, write_midi
from txl_deploy.music.generation import priming
from txl_deploy.music.grammar import compiled
from txl_deploy.music.midi_file import Note
from txl_deploy.music.midi_to_events import midi_to_events
from txl_deploy.music.piano_roll import piano_roll, piano_roll_size
from txl_deploy.runtimes import TxlRuntime

pytest.importorskip("torch")
pytest.importorskip("mido")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("songs")
    return {"remi": save_event_model(root / "REMI-tempo-checkpoint", "remi"),
            "remi-chord": save_event_model(root / "REMI-tempo-chord-checkpoint", "remi"),
            "remi-xl": save_event_model(root / "remi-xl", "remi-xl")}


def _lines(path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def _png(path) -> tuple[int, int, np.ndarray]:
    """(width, height, pixels) of an 8-bit RGB PNG, every chunk's CRC checked (read here, not by the code under
    test)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = {}, 8
    while at < len(data):
        (length,), kind = struct.unpack(">I", data[at:at + 4]), data[at + 4:at + 8]
        body = data[at + 8:at + 8 + length]
        assert struct.unpack(">I", data[at + 8 + length:at + 12 + length])[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        at += 12 + length
    assert set(chunks) == {b"IHDR", b"IDAT", b"IEND"}
    width, height, depth, colour = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour) == (8, 2)
    rows = np.frombuffer(zlib.decompress(chunks[b"IDAT"]), dtype=np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any()  # filter 0 on every row
    return width, height, rows[:, 1:].reshape(height, width, 3)


@pytest.mark.parametrize("rep", ["remi", "remi-xl"])
def test_the_midi_file_is_what_the_writer_makes_of_the_events_file(models, rep, tmp_path):
    out, events, roll = tmp_path / "song.mid", tmp_path / "song.txt", tmp_path / "song.png"
    r = cli("generate", models[rep], "--midi", out, "--events", events, "--piano-roll", roll, "--bars", 2,
            "--seed", 7)
    assert r.exit_code == 0, r.output
    written = _lines(events)
    again = write_midi(written, rep, tmp_path / "again.mid")
    assert out.read_bytes() == (tmp_path / "again.mid").read_bytes()
    assert again.notes, "the song has notes"
    assert f"{len(again.notes)} notes" in r.output
    width, height, pixels = _png(roll)
    assert (width, height) == piano_roll_size(again.notes)
    first = again.notes[0]  # its first pixel row and column are drawn in the note's shade, not the background
    top = (max(n.pitch for n in again.notes) - first.pitch) * 4
    assert tuple(pixels[top, first.start // 30 + 1]) != (250, 250, 250)


def test_bars_stops_after_that_many_bar_events_with_every_event_placed(models):
    with TxlRuntime.load(models["remi"]) as rt:
        events = generate_music(rt, bars=2, seed=11)
    # the priming's bar, then two generated: the last closes bar 2, as REMI's generate stops
    assert events[:2] == ["Bar_None", "Position_1/16"] and events[-1] == "Bar_None"
    assert events.count("Bar_None") == 3
    assert compiled("remi", SYMBOLS["remi"]).first_error([SYMBOLS["remi"].index(e) for e in events]) is None
    score = events_to_score(events, "remi")
    assert len(score.notes) == sum(e.startswith("Note On_") for e in events)
    assert len(score.tempos) == sum(e.startswith("Tempo Class_") for e in events)
    assert len(score.markers) == sum(e.startswith("Chord_") for e in events)
    assert all(note.start < 2 * 1920 for note in score.notes)


def test_remi_xl_starts_from_a_bar_and_stops_at_eos_or_the_limit(models):
    with TxlRuntime.load(models["remi-xl"]) as rt:
        events = generate_music(rt, seed=2, max_events=300)
    assert events[0] == "Bar_None"
    assert events[-1] == "EOS_None" or len(events) == 301
    assert events.count("EOS_None") <= 1
    placed = events_to_score(events, "remi-xl").notes
    assert len(placed) == sum(e.startswith("Note_Pitch_") for e in events[:-3] if e != "EOS_None")


def test_a_seeded_song_repeats_and_another_seed_differs(models):
    with TxlRuntime.load(models["remi"]) as rt:
        one, two, other = (generate_music(rt, bars=3, seed=s, temperature=1.2, top_k=5) for s in (4, 4, 5))
    assert one == two
    assert one != other


def test_without_the_grammar_the_tokens_are_those_generate_samples(models):
    with TxlRuntime.load(models["remi-xl"]) as rt:
        events = generate_music(rt, grammar=False, seed=9, max_events=40, bars=50)
        rt.reset()
        bar, eos = SYMBOLS["remi-xl"].index("Bar_None"), SYMBOLS["remi-xl"].index("EOS_None")
        tokens = list(rt.generate([bar], max_new_tokens=40, seed=9, stop=[eos]))
    assert events == ["Bar_None"] + [SYMBOLS["remi-xl"][t] for t in tokens]


def test_remi_priming_draws_tempo_and_for_chord_models_a_chord(models, tmp_path):
    rng = np.random.default_rng(0)
    plain, chord = priming(SYMBOLS["remi"], "remi", rng=rng), priming(SYMBOLS["remi"], "remi", True, rng)
    assert plain[:2] == ["Bar_None", "Position_1/16"] and plain[2].startswith("Tempo Class_")
    assert plain[3].startswith("Tempo Value_") and len(plain) == 4
    assert chord[:2] == ["Bar_None", "Position_1/16"] and chord[2].startswith("Chord_") and chord[3:4] == plain[1:2]
    assert priming(SYMBOLS["remi-xl"], "remi-xl", True) == ["Bar_None"]
    # the command line decides chords by the model's name, as upstream does by the folder's
    r = cli("generate", models["remi-chord"], "--events", tmp_path / "c.txt", "--bars", 1, "--seed", 1)
    assert r.exit_code == 0, r.output
    assert _lines(tmp_path / "c.txt")[2].startswith("Chord_")
    r = cli("generate", models["remi-chord"], "--events", tmp_path / "n.txt", "--bars", 1, "--no-chords")
    assert _lines(tmp_path / "n.txt")[2].startswith("Tempo Class_")


def test_a_prompt_midi_file_is_continued_after_a_new_bar(models, tmp_path):
    with TxlRuntime.load(models["remi"]) as rt:
        write_midi(generate_music(rt, bars=2, seed=3), "remi", tmp_path / "prompt.mid")
    prompt = midi_to_events(tmp_path / "prompt.mid", "remi")
    r = cli("generate", models["remi"], "--midi", tmp_path / "more.mid", "--events", tmp_path / "more.txt",
            "--prompt-midi", tmp_path / "prompt.mid", "--bars", 1, "--seed", 3)
    assert r.exit_code == 0, r.output
    events = _lines(tmp_path / "more.txt")
    assert events[:len(prompt) + 1] == prompt + ["Bar_None"]
    assert events[len(prompt) + 1:].count("Bar_None") == 1 and events[-1] == "Bar_None"


def test_outputs_are_kept_unless_forced_and_checked_before_generating(models, tmp_path):
    out = tmp_path / "song.mid"
    out.write_bytes(b"mine")
    r = cli("generate", models["remi"], "--midi", out, "--bars", 1)
    assert r.exit_code != 0 and "exists" in r.output and out.read_bytes() == b"mine"
    r = cli("generate", models["remi"], "--midi", out, "--bars", 1, "--force")
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:4] == b"MThd"


def test_a_model_whose_vocabulary_is_not_music_is_one_line(tiny_ckpt, tmp_path):
    r = cli("generate", tiny_ckpt, "--midi", tmp_path / "song.mid")
    assert_one_line_error(r, "not one of music events", "--representation")
    assert not (tmp_path / "song.mid").exists()


def test_song_options_without_a_song_are_usage_errors(models, tmp_path):
    r = cli("generate", models["remi"], "--prompt", "Bar_None", "--bars", 2)
    assert r.exit_code == 2 and "--midi" in r.output
    r = cli("generate", models["remi"], "--midi", tmp_path / "s.mid", "--prompt", "Bar_None")
    assert r.exit_code == 2 and "--prompt-midi" in r.output


def test_a_song_cut_short_by_the_limit_says_so(models, caplog):
    with TxlRuntime.load(models["remi"]) as rt, caplog.at_level("WARNING", logger="txl_deploy"):
        events = generate_music(rt, bars=50, max_events=6, seed=1)
    assert len(events) == 4 + 6
    assert "stopped at the limit of 6 events" in caplog.text and "of 50 bars" in caplog.text


def test_a_piano_roll_too_large_is_refused_before_it_is_drawn():
    with pytest.raises(InputError, match="too large"):
        piano_roll([Note(0, 1 << 40, 0, 80), Note(0, 120, 127, 80)])


def test_a_grammar_or_prompt_the_representation_lacks_is_one_line(models, tmp_path):
    r = cli("generate", models["remi-xl"], "--midi", tmp_path / "s.mid", "--grammar", "remi")
    assert_one_line_error(r, "--grammar remi", "remi-xl")
    write_midi(["Bar_None", "Beat_0", "Note_Pitch_60", "Note_Velocity_64", "Note_Duration_480", "Bar_None"],
               "remi-xl", tmp_path / "prompt.mid")
    r = cli("generate", models["remi-xl"], "--midi", tmp_path / "s.mid", "--prompt-midi", tmp_path / "prompt.mid")
    assert_one_line_error(r, "remi only")
    assert not (tmp_path / "s.mid").exists()
