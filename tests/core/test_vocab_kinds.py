"""Vocabulary kinds of the paper's character corpora: `bytes` (enwik8) and `text8`, their detection, the incremental
stream decoder, and refusals. The word and char kinds keep their behaviour (checked here against the stream
decoder; their own tests are elsewhere)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.vocab import CONTINUING, UnknownKindError, Vocab, choose_kind, detect_kind

ALL_BYTES_BUT_NEWLINE = [str(b) for b in range(256) if b != 10]
TEXT8 = list("_etaoinsrhldcumfpgwybvkxjqz")  # frequency order, as the original build_vocab leaves it


@pytest.fixture
def enwik8():
    # enwik8's own vocabulary holds 204 bytes in frequency order; any order of byte values is read the same way
    rng = np.random.default_rng(0)
    return Vocab(list(rng.permutation(ALL_BYTES_BUT_NEWLINE)), kind="bytes")


@pytest.fixture
def text8():
    return Vocab(TEXT8, kind="text8")


# -- bytes -----------------------------------------------------------------------------------------------------
def test_bytes_round_trip_utf8_with_non_ascii_text(enwik8):
    text = "Zürich — 東京, naïve café ✓ 🎉"
    ids = enwik8.encode(text)
    assert [enwik8.symbols[i] for i in ids] == [str(b) for b in text.encode("utf-8")]
    assert len(ids) == len(text.encode("utf-8")) > len(text)
    assert enwik8.decode(ids) == text


def test_bytes_drop_newlines_as_the_preprocessing_did(enwik8):
    ids = enwik8.encode("one\ntwo\r\n")
    assert enwik8.decode(ids) == "onetwo\r"
    ids, counts = enwik8.encode_corpus(b"one\ntwo\n\xe2\x82")  # a split may cut a character: raw bytes are fine
    assert counts == {"raw_bytes": 10, "newlines": 2, "newlines_are": "dropped", "symbols": 8}
    assert enwik8.decode(ids) == "onetwo\ufffd"
    # a vocabulary that holds byte 10 keeps newlines; one with <eos> reads a newline as <eos>
    with_newline = Vocab([str(b) for b in range(256)], kind="bytes")
    assert with_newline.decode(with_newline.encode("a\nb")) == "a\nb"
    with_eos = Vocab(ALL_BYTES_BUT_NEWLINE + ["<eos>"], kind="bytes")
    assert with_eos.encode("a\nb").tolist()[1] == with_eos.index["<eos>"]
    assert with_eos.decode(with_eos.encode("a\nb")) == "a\nb"


def test_a_byte_the_vocabulary_lacks_is_named_or_unk():
    seen = list(dict.fromkeys(str(b) for b in b"plain ASCII text"))
    vocab = Vocab(seen, kind="bytes")
    with pytest.raises(InputError, match=r"byte 195 \(0xc3, of 'é' at byte 5\).*has no <unk>.*holds 13 of the 256"):
        vocab.encode("text é")
    with pytest.raises(InputError, match=r"byte 255 \(0xff, in an invalid UTF-8 sequence at byte 1\)"):
        vocab.encode_bytes(b"t\xff")
    with_unk = Vocab(seen + ["<unk>"], kind="bytes")
    ids = with_unk.encode("té")
    assert ids.tolist() == [with_unk.index["116"], with_unk.index["<unk>"], with_unk.index["<unk>"]]
    assert with_unk.decode(ids) == "t\ufffd\ufffd"


def test_stream_decoder_prints_a_split_character_once_whole(enwik8):
    decoder = enwik8.stream_decoder()
    pieces = [decoder.feed(i) for i in enwik8.encode("a€b🎉")]
    assert pieces == ["a", "", "", "€", "b", "", "", "", "🎉"]
    assert decoder.flush() == ""
    # a stream cut inside a character: nothing of it is printed until flush, which replaces it
    decoder = enwik8.stream_decoder()
    assert [decoder.feed(i) for i in enwik8.encode("x€")[:2]] == ["x", ""]
    assert decoder.flush() == "\ufffd"
    with pytest.raises(InputError, match="outside the vocabulary"):
        decoder.feed(len(enwik8))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(range(256))) | st.sampled_from([0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0xED, 0xA0]),
                max_size=40))
def test_stream_decoder_equals_utf8_replace_and_never_takes_back_text(values):
    """Any byte stream: the pieces join to Python's `decode("utf-8", "replace")` of the bytes, and what was printed
    after each token is a prefix of the final text (nothing printed is ever garbage to be taken back)."""
    vocab = Vocab([str(b) for b in range(256)], kind="bytes")
    ids = [vocab.byte_ids[v] for v in values]
    decoder = vocab.stream_decoder()
    printed = ""
    want = bytes(values).decode("utf-8", "replace")
    for i in ids:
        printed += decoder.feed(i)
        assert want.startswith(printed)
    assert printed + decoder.flush() == want == vocab.decode(ids)


# -- text8 -----------------------------------------------------------------------------------------------------
def test_text8_round_trip_with_underscore_for_the_space(text8):
    text = "the quick brown fox jumps over the lazy dog"
    ids = text8.encode(text)
    assert "".join(text8.symbols[i] for i in ids) == text.replace(" ", "_")
    assert text8.decode(ids) == text
    assert text8.decode(text8.encode(" leading and trailing ")) == " leading and trailing "
    decoder = text8.stream_decoder()
    assert "".join(decoder.feed(i) for i in ids) + decoder.flush() == text


def test_text8_refuses_what_it_does_not_hold(text8):
    for text, bad in (("The cat", "'T'"), ("cat_dog", "'_'"), ("naïve", "'ï'"), ("4 cats", "'4'")):
        with pytest.raises(InputError, match=f"character {bad} is not in this text8 vocabulary, which holds "
                                             r"lowercase a-z and spaces only"):
            text8.encode(text)
    # other whitespace is dropped, as the original tokenizer drops it
    assert text8.decode(text8.encode("one\ttwo\nthree")) == "onetwothree"
    with_unk = Vocab(TEXT8 + ["<unk>"], kind="text8")
    assert with_unk.decode(with_unk.encode("The")) == "\ufffdhe"


def test_text8_corpus_is_read_as_prep_text8_cut_it(text8):
    ids, counts = text8.encode_corpus(" anarchism originated as a term \n")
    assert text8.decode(ids) == "anarchism originated as a term"
    assert counts == {"characters": 33, "stripped": 3, "symbols": 30}


# -- detection and refusals ------------------------------------------------------------------------------------
def test_kind_comes_from_the_corpus_the_symbols_or_the_user():
    assert detect_kind(ALL_BYTES_BUT_NEWLINE[:204]) == "bytes"
    assert detect_kind(TEXT8) == "text8"
    assert detect_kind(TEXT8 + ["<unk>"]) == "text8"
    assert detect_kind(TEXT8[:-1]) is None  # exactly a-z and _: a subset could be a word list
    assert detect_kind(["the", "of", "84"]) is None and detect_kind(["084", "1"]) is None
    assert detect_kind(["256", "1"]) is None and detect_kind(["<eos>"]) is None
    assert choose_kind(["the", "of"]) == "word" and choose_kind(["a", "b"], default="char") == "char"
    assert choose_kind(["1", "2"], dataset="enwik8") == "bytes"
    assert choose_kind(list("abc_"), dataset="text8") == "text8"  # the corpus says so even for a subset
    assert choose_kind(ALL_BYTES_BUT_NEWLINE, explicit="word") == "word"
    with pytest.raises(ValueError, match="its corpus is enwik8.*symbol 'the' is not a byte value"):
        choose_kind(["the", "1"], dataset="enwik8")
    with pytest.raises(ValueError, match="cannot be a text8 vocabulary: symbol 'A'"):
        choose_kind(["A", "b"], explicit="text8")
    with pytest.raises(ValueError, match="not a bytes vocabulary"):
        Vocab(["1", "x"], kind="bytes")


def test_vocab_files_are_read_with_their_kind(tmp_path):
    txt = tmp_path / "vocab.txt"
    txt.write_text("".join(f"{s}\n" for s in ALL_BYTES_BUT_NEWLINE[:204]))
    assert Vocab.read(txt).kind == "bytes"
    assert Vocab.read(txt, kind="word").kind == "word"
    txt.write_text("".join(f"{s} 12\n" for s in TEXT8))  # the first field of a line, as the original reads it
    assert Vocab.read(txt).kind == "text8"
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(TEXT8))
    assert Vocab.read(listed).kind == "text8"
    ours = tmp_path / "vocab.json"
    Vocab(ALL_BYTES_BUT_NEWLINE, kind="word").save(ours)  # ours says its kind: not second-guessed
    assert Vocab.read(ours).kind == "word"
    assert Vocab.read(ours, kind="bytes") == Vocab(ALL_BYTES_BUT_NEWLINE, kind="bytes")
    with pytest.raises(CheckpointError, match="vocab.txt: cannot be a bytes vocabulary"):
        Vocab.read(txt, kind="bytes")


@pytest.mark.parametrize("separator", ["\x85", "\u2028", "\x1c", "\x0b", "\x0c"])
def test_a_symbol_line_ends_at_a_newline_only(tmp_path, separator):
    # the original reader takes each line's first whitespace field: a line break of str.splitlines inside a
    # symbol ends the symbol there, never the line, so every later symbol keeps its id
    txt = tmp_path / "vocab.txt"
    txt.write_text(f"<eos>\nthe\nfoo{separator}bar\nof\n\n", encoding="utf-8")
    assert Vocab.read(txt, kind="word").symbols == ["<eos>", "the", "foo", "of"]
    txt.write_text(f"<eos>\n{separator}\nof\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match="vocab.txt: line 2 holds no symbol"):
        Vocab.read(txt, kind="word")


def test_an_unknown_kind_is_refused_never_read_as_another(tmp_path):
    with pytest.raises(UnknownKindError, match="kind 'bpe' is not one this txl-deploy knows.*upgrade"):
        Vocab.from_dict({"kind": "bpe", "symbols": ["a", "b"]})
    path = tmp_path / "vocab.json"
    path.write_text(json.dumps({"kind": "bpe", "symbols": ["a", "b"]}))
    with pytest.raises(CheckpointError, match="vocab.json: vocabulary kind 'bpe' is not one this txl-deploy knows"):
        Vocab.read(path)


# -- word and char keep their behaviour --------------------------------------------------------------------------
def test_word_stream_joins_to_decode_and_continues_a_prompt():
    vocab = Vocab(["<eos>", "<unk>", "the", "cat", "sat"])
    ids = [2, 3, 0, 0, 4, 2, 0, 3]
    decoder = vocab.stream_decoder()
    assert "".join(decoder.feed(i) for i in ids) + decoder.flush() == vocab.decode(ids) == "the cat\n\nsat the\ncat"
    assert [vocab.stream_decoder("the").feed(3), vocab.stream_decoder("the ").feed(3)] == [" cat", "cat"]
    assert vocab.stream_decoder(CONTINUING).feed(3) == " cat"
    assert vocab.piece(3) == " cat" and vocab.piece(0) == "\n"  # unchanged


def test_char_stream_is_the_symbols():
    vocab = Vocab(list("ab\n_ "), kind="char")
    decoder = vocab.stream_decoder()
    assert [decoder.feed(i) for i in (0, 3, 4, 2, 1)] == ["a", "_", " ", "\n", "b"]
    assert vocab.decode(vocab.encode("a_ b\n")) == "a_ b\n"
