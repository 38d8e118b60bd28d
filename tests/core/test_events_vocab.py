"""The `events` vocabulary kind (music models: REMI, remi-xl, ProgGP): event symbols kept verbatim, spaces included;
event lists and one-event-a-line text to ids and back; the music representation stored with the vocabulary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.music.representation import REMI, of_vocab
from txl_deploy.vocab import KINDS, UnknownKindError, Vocab

REMI_EVENTS = ["Bar_None", "Position_1/16", "Position_9/16", "Note Velocity_20", "Note On_60", "Note On_64",
               "Note Duration_7", "Chord_C:maj", "Chord_N:N", "Tempo Class_mid", "Tempo Value_12"]


def remi_vocab(**kwargs) -> Vocab:
    return Vocab(REMI_EVENTS, kind="events", **kwargs)


def test_events_are_encoded_whole_and_decoded_one_a_line():
    vocab = remi_vocab(representation="remi")
    events = ["Bar_None", "Position_1/16", "Note Velocity_20", "Note On_60", "Note Duration_7", "Chord_C:maj"]
    ids = vocab.encode_events(events)
    assert ids.dtype == np.int64 and ids.tolist() == [REMI_EVENTS.index(e) for e in events]
    assert vocab.events(ids) == events
    text = vocab.decode(ids)
    assert text == "".join(e + "\n" for e in events)
    assert vocab.encode(text).tolist() == ids.tolist()
    # blank lines, a missing final line end, Windows line ends and spaces around an event are tolerated
    assert vocab.encode("\nBar_None\r\n\n  Note On_60 \nChord_C:maj").tolist() == [0, 4, 7]
    assert vocab.encode("").tolist() == [] and vocab.decode([]) == ""


def test_an_unknown_event_is_a_one_line_error_saying_how_to_list_the_vocabulary():
    vocab = remi_vocab()
    for call in (lambda: vocab.encode("Bar_None\nNote On_61\n"), lambda: vocab.encode_events(["Bar_None", "Note On"])):
        with pytest.raises(InputError) as e:
            call()
        message = str(e.value)
        assert "\n" not in message and "event 2" in message and "--list-vocab" in message
    with pytest.raises(InputError, match="list of event symbols"):
        vocab.encode_events("Bar_None")
    with pytest.raises(InputError, match="outside the vocabulary"):
        vocab.decode([len(REMI_EVENTS)])
    with pytest.raises(InputError, match="events vocabularies"):
        Vocab(["a", "b"]).encode_events(["a"])


def test_a_stream_of_events_prints_one_event_a_line():
    vocab = remi_vocab()
    ids = [0, 1, 3, 4, 6]
    assert "".join(vocab.stream_decoder().pieces(ids)) == vocab.decode(ids)
    # continuing a prompt whose last line is open: the line is ended first
    assert vocab.stream_decoder(after="Bar_None").feed(1) == "\nPosition_1/16\n"
    assert vocab.stream_decoder(after="Bar_None\n").feed(1) == "Position_1/16\n"
    assert vocab.piece(4) == "Note On_60\n"


def test_the_representation_travels_with_the_vocabulary_as_json():
    vocab = remi_vocab(representation="remi")
    d = json.loads(vocab.to_json())
    assert d == {"kind": "events", "symbols": REMI_EVENTS, "representation": "remi"}
    back = Vocab.from_dict(d)
    assert back == vocab and back.symbols == REMI_EVENTS and back.representation == "remi"
    assert back != remi_vocab() and back.with_representation(None) == remi_vocab()
    assert of_vocab(back) is REMI and of_vocab(remi_vocab()) is REMI  # stored, else detected
    assert of_vocab(Vocab(["a", "b"])) is None
    assert "events" in KINDS and "representation='remi'" in repr(vocab)


def test_only_an_events_vocabulary_names_a_representation_and_its_events_fit_one_a_line():
    with pytest.raises(ValueError, match="only an events vocabulary"):
        Vocab(["a", "b"], kind="word", representation="remi")
    with pytest.raises(ValueError, match="no music representation"):
        Vocab(["a", "b"]).with_representation("remi")
    for bad in ("two\nlines", " padded", "", "carriage\r"):
        with pytest.raises(ValueError, match="cannot be written one a line"):
            Vocab(["Bar_None", bad], kind="events")
    with pytest.raises(UnknownKindError):
        Vocab.from_dict({"kind": "midi", "symbols": ["a"]})


def test_an_events_vocab_txt_keeps_each_line_whole(tmp_path):
    """The one-symbol-a-line vocab.txt reads only a line's first word; read as events, each line is one event."""
    path = tmp_path / "vocab.txt"
    path.write_text("".join(e + "\n" for e in REMI_EVENTS) + "\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="duplicate symbol 'Note'"):  # the word reading splits REMI's events
        Vocab.read(path)
    vocab = Vocab.read(path, kind="events")
    assert vocab.kind == "events" and vocab.symbols == REMI_EVENTS
    path.write_text("Bar_None\n\nNote On_60\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="line 2 holds no event"):
        Vocab.read(path, kind="events")
    json_path = tmp_path / "vocab.json"
    remi_vocab(representation="remi").save(json_path)
    assert Vocab.read(json_path) == remi_vocab(representation="remi")


def test_an_events_corpus_is_scored_per_event():
    vocab = remi_vocab()
    ids, counts = vocab.encode_corpus("Bar_None\nPosition_1/16\nNote On_60\n")
    assert ids.tolist() == [0, 1, 4] and counts["symbols"] == 3
