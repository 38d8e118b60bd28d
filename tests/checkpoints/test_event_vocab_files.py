"""Music models' event vocabularies read without running them: REMI's and remi-xl's `dictionary.pkl` (a pickled
`(event2word, word2event)` pair) and ProgGP's two files, each written here in its project's layout. The events come
back verbatim as an `events` vocabulary naming its representation (detected, or as the user says); a dictionary.pkl
beside a checkpoint is found; the two dicts must agree; a hostile pickle runs nothing; every mistake is one line."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from helpers.cli import assert_one_line_error, cli  # noqa: E402
from helpers.tiny import make_tiny_model  # noqa: E402

from txl_deploy.checkpoints import load_model  # noqa: E402
from txl_deploy.checkpoints.vocab_files import find_vocab, open_vocab_file, read_vocab_file  # noqa: E402
from txl_deploy.errors import CheckpointError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# REMI's events (YatingMusic/remi): names with spaces, positions k/16, chords root:quality, tempo classes and values.
REMI_EVENTS = (["Bar_None"] + [f"Position_{k}/16" for k in range(1, 17)] + [f"Note Velocity_{v}" for v in (16, 20)]
               + [f"Note On_{p}" for p in (60, 62, 64, 65, 67)] + [f"Note Duration_{d}" for d in (1, 3, 7)]
               + ["Chord_C:maj", "Chord_A:min", "Chord_N:N", "Tempo Class_slow", "Tempo Class_mid", "Tempo Value_12"])
# remi-xl's events (compound-word-transformer's REMI baseline)
REMI_XL_EVENTS = (["Bar_None", "EOS_None"] + [f"Beat_{b}" for b in range(16)] + ["Chord_C_M", "Chord_N_N", "Tempo_120"]
                  + [f"Note_{name}_{v}" for name in ("Pitch", "Velocity") for v in (60, 64)] + ["Note_Duration_480"])
# ProgGP's DadaGP tokens: neither representation
PROGGP_EVENTS = ["wait:240", "wait:480", "drums:note:36", "nfx:tie", "new_measure", "artist:zz_top"]


def dictionary_pkl(folder, events, protocol=pickle.DEFAULT_PROTOCOL, name="dictionary.pkl"):
    """A dictionary.pkl as the projects write it: `pickle.dump((event2word, word2event), f)`."""
    path = folder / name
    path.write_bytes(pickle.dumps(({e: i for i, e in enumerate(events)}, dict(enumerate(events))), protocol=protocol))
    return path


def proggp_pair(folder, events):
    """ProgGP's vocab_song_artist.pkl (event -> id) and rev_vocab_song_artist.pkl (id -> event)."""
    (folder / "vocab_song_artist.pkl").write_bytes(pickle.dumps({e: i for i, e in enumerate(events)}, protocol=3))
    (folder / "rev_vocab_song_artist.pkl").write_bytes(pickle.dumps(dict(enumerate(events)), protocol=3))
    return folder / "vocab_song_artist.pkl"


@pytest.mark.parametrize("protocol", [2, 3, pickle.HIGHEST_PROTOCOL])
def test_a_remi_dictionary_is_an_events_vocabulary_kept_verbatim(tmp_path, protocol):
    found = open_vocab_file(dictionary_pkl(tmp_path, REMI_EVENTS, protocol))
    vocab = found.vocab
    assert vocab.kind == "events" and vocab.representation == "remi" and vocab.symbols == REMI_EVENTS
    assert "Note On_60" in vocab.index and "Position_1/16" in vocab.index and "Chord_C:maj" in vocab.index
    assert "dictionary.pkl" in found.format and "read without running it" in found.format
    events = ["Bar_None", "Position_1/16", "Chord_C:maj", "Note Velocity_20", "Note On_64", "Note Duration_7"]
    assert vocab.events(vocab.encode("\n".join(events) + "\n")) == events
    assert vocab.decode(vocab.encode_events(events)) == "".join(e + "\n" for e in events)


def test_a_remi_xl_dictionary_names_remi_xl(tmp_path):
    vocab = read_vocab_file(dictionary_pkl(tmp_path, REMI_XL_EVENTS))
    assert vocab.kind == "events" and vocab.representation == "remi-xl" and vocab.symbols == REMI_XL_EVENTS
    assert vocab.events(vocab.encode("Bar_None\nBeat_0\nNote_Pitch_60\nEOS_None\n")) == \
        ["Bar_None", "Beat_0", "Note_Pitch_60", "EOS_None"]


def test_proggp_two_files_read_as_one_vocabulary_from_either(tmp_path):
    forward = proggp_pair(tmp_path, PROGGP_EVENTS)
    for path in (forward, tmp_path / "rev_vocab_song_artist.pkl"):
        found = open_vocab_file(path)
        assert found.vocab.kind == "events" and found.vocab.symbols == PROGGP_EVENTS
        assert found.vocab.representation is None  # DadaGP tokens: no representation written as MIDI
        assert "rev_vocab_song_artist.pkl" in found.format
    assert find_vocab(tmp_path) == forward
    (tmp_path / "rev_vocab_song_artist.pkl").unlink()
    with pytest.raises(CheckpointError, match="rev_vocab_song_artist.pkl"):
        open_vocab_file(forward)


def test_an_event_dictionary_under_another_name_is_read_as_one(tmp_path):
    path = dictionary_pkl(tmp_path, REMI_EVENTS, name="remi-dict.pkl")
    assert read_vocab_file(path).symbols == REMI_EVENTS
    with pytest.raises(CheckpointError, match="not a vocabulary"):
        (tmp_path / "other.pkl").write_bytes(pickle.dumps(([1], [2])))
        read_vocab_file(tmp_path / "other.pkl")


def test_the_representation_can_be_overridden_and_must_fit(tmp_path):
    path = dictionary_pkl(tmp_path, ["Bar_None", "Note On_60", "Position_1/16"])
    assert read_vocab_file(path, representation="remi").representation == "remi"
    with pytest.raises(CheckpointError, match="'Note On_60' is not one of the remi-xl"):
        read_vocab_file(path, representation="remi-xl")
    text = tmp_path / "events.txt"
    text.write_text("Bar_None\nNote On_60\nPosition_1/16\n")
    vocab = read_vocab_file(text, representation="remi")  # a representation reads a text file as events
    assert vocab.kind == "events" and vocab.symbols[1] == "Note On_60" and vocab.representation == "remi"


@pytest.mark.parametrize("events, name", [(REMI_EVENTS, "remi"), (REMI_XL_EVENTS, "remi-xl")])
def test_a_text_list_of_events_is_read_as_events_without_flags(tmp_path, events, name):
    """One event a line, as `info --list-vocab` and the projects' dictionaries hold them: REMI's events keep their
    spaces (read as words, `Note On_60` would be `Note`, a duplicate); a word list stays a word list."""
    path = tmp_path / "events.txt"
    path.write_text("".join(e + "\n" for e in events))
    found = open_vocab_file(path)
    assert found.vocab.kind == "events" and found.vocab.symbols == events and "one event a line" in found.format
    assert read_vocab_file(path).representation == name
    (tmp_path / "words.txt").write_text("the\nNote On\nBar_None\n")  # not all events of one representation
    assert read_vocab_file(tmp_path / "words.txt").kind == "word"


def disagree(tmp_path, event2word, word2event) -> str:
    path = tmp_path / "dictionary.pkl"
    path.write_bytes(pickle.dumps((event2word, word2event)))
    with pytest.raises(CheckpointError) as e:
        read_vocab_file(path)
    assert "\n" not in str(e.value) and "dictionary.pkl" in str(e.value)
    return str(e.value)


def test_the_two_dicts_must_be_each_others_inverse_over_ids_0_to_n_minus_1(tmp_path):
    good = {"Bar_None": 0, "Note On_60": 1}
    assert "disagree" in disagree(tmp_path, good, {0: "Bar_None", 1: "Note On_61"})
    assert "2 events but word2event 1" in disagree(tmp_path, good, {0: "Bar_None"})
    assert "0..1" in disagree(tmp_path, {"Bar_None": 0, "Note On_60": 2}, {0: "Bar_None", 2: "Note On_60"})
    # a claimed id of 10**12 is refused before anything is built from it
    assert "a huge number" in disagree(tmp_path, {"Bar_None": 10**12}, {10**12: "Bar_None"})
    assert "disagree" in disagree(tmp_path, {"a": 0, "b": 0}, {0: "a", 1: "b"})
    assert "not an event" in disagree(tmp_path, {"a": "0"}, {0: "a"})
    assert "not an id" in disagree(tmp_path, {"a": 0}, {"0": "a"})
    assert "empty" in disagree(tmp_path, {}, {})
    # Compound Word's cp dictionary: one pair of dicts per event family, not events
    assert "not an event" in disagree(tmp_path, {"tempo": {"0": 0}}, {"tempo": {0: "0"}})
    assert "one a line" in disagree(tmp_path, {"Bar None\n": 0}, {0: "Bar None\n"})


class Reduce:
    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


@pytest.mark.parametrize("name", ["dictionary.pkl", "vocab_song_artist.pkl", "rev_vocab_song_artist.pkl", "x.pkl"])
def test_a_hostile_event_dictionary_runs_nothing(tmp_path, name):
    canary = tmp_path / "canary"
    payload = Reduce(os.system, f"touch {canary}")
    pair = ({"Bar_None": 0}, {0: payload})
    path = tmp_path / name
    path.write_bytes(pickle.dumps(pair if name in ("dictionary.pkl", "x.pkl") else {0: payload}))
    if name != "x.pkl":  # the file is dangerous: a plain pickle.load runs it
        subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(path)!r}, 'rb'))"], check=True)
        assert canary.exists()
        canary.unlink()
    (tmp_path / ("vocab_song_artist.pkl" if name.startswith("rev_") else "rev_" + name)).write_bytes(
        pickle.dumps({"Bar_None": 0} if name.startswith("rev_") else {0: "Bar_None"}))
    with pytest.raises(CheckpointError) as e:
        read_vocab_file(path)
    assert "refused to unpickle" in str(e.value) and "system" in str(e.value) and "\n" not in str(e.value)
    assert not canary.exists()


def test_a_truncated_event_dictionary_is_one_line(tmp_path):
    path = dictionary_pkl(tmp_path, REMI_EVENTS)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_vocab_file(path)


def tiny_events_model(tmp_path, events):
    """A bare state_dict (weights.pt + weights.json) whose n_token is the events', with `dictionary.pkl` beside it,
    as a music checkpoint's folder holds one."""
    model = make_tiny_model(n_token=len(events))
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    (tmp_path / "weights.json").write_text(model.cfg.to_json())
    dictionary_pkl(tmp_path, events)
    return tmp_path / "weights.pt"


def test_a_dictionary_beside_a_checkpoint_is_found_and_shown_by_info(tmp_path):
    weights = tiny_events_model(tmp_path, REMI_EVENTS)
    loaded = load_model(weights)
    assert loaded.vocab.kind == "events" and loaded.vocab.symbols == REMI_EVENTS
    assert loaded.vocab.representation == "remi" and loaded.vocab_source == str(tmp_path / "dictionary.pkl")
    result = cli("info", weights)
    assert result.exit_code == 0, result.output
    assert "kind events" in result.output and "representation: remi" in result.output
    listed = cli("info", weights, "--list-vocab")
    assert "2\t'Position_2/16'" in listed.output and "'Note On_60'" in listed.output
    assert_one_line_error(cli("info", weights, "--representation", "remi-xl"), "is not one of the remi-xl")


def test_a_representation_for_a_word_vocabulary_is_refused(tmp_path):
    weights = tiny_events_model(tmp_path, REMI_EVENTS)
    (tmp_path / "vocab.txt").write_text("".join(f"w{i}\n" for i in range(len(REMI_EVENTS))))
    assert load_model(weights).vocab.kind == "word"  # vocab.txt comes first
    assert_one_line_error(cli("info", weights, "--vocab-kind", "word", "--representation", "remi"),
                          "events vocabularies")
