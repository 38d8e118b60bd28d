"""The wikitext tokenizer against HuggingFace's TransfoXLTokenizer (transformers' deprecated transfo_xl, the
tokenizer of transfo-xl-wt103), built from a vocabulary file written here: the same ids for ~100 sentences and the
same text decoded back; streamed pieces join to `decode` and are never changed by a later word."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from txl_deploy.vocab import CONTINUING, Vocab

SENTENCES = (Path(__file__).parent / "data" / "word_sentences.txt").read_text(encoding="utf-8").splitlines()
# words left out of the vocabulary, so that <unk> is exercised
LEFT_OUT = ("revenue", "Zürich", "🎉", "@.@")


def oracle(tmp_path, symbols, lower_case=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # late: transformers is the test oracle only, heavy to import
        from transformers.models.deprecated.transfo_xl import TransfoXLTokenizer

        path = tmp_path / f"vocab-{lower_case}.txt"
        path.write_text("".join(s + "\n" for s in symbols), encoding="utf-8")
        return TransfoXLTokenizer(vocab_file=str(path), unk_token="<unk>", eos_token="<eos>", lower_case=lower_case)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(our wikitext Vocab, the oracle) over the oracle's own words for SENTENCES, less LEFT_OUT."""
    tmp = tmp_path_factory.mktemp("wt")
    bare = oracle(tmp, ["<unk>", "<eos>"])
    words = sorted({w for s in SENTENCES for w in bare.tokenize(s)} - set(LEFT_OUT))
    symbols = ["<unk>", "<eos>", *words]
    hf = oracle(tmp, symbols)
    return Vocab(symbols, never_split=hf.never_split), hf


def test_the_vocabulary_is_detected_as_wikitext_and_left_out_words_are_unk(pair):
    vocab, _ = pair
    assert vocab.tokenizer == "wikitext" and len(SENTENCES) >= 100
    ids = vocab.encode("Zürich's revenue rose")
    assert [vocab.symbols[i] for i in ids] == ["<unk>", "'s", "<unk>", "rose"]


def test_ids_match_transfo_xl_tokenizer(pair):
    vocab, hf = pair
    for sentence in SENTENCES:
        expected = hf.convert_tokens_to_ids(hf.tokenize(sentence))
        assert list(vocab.encode(sentence)) == expected, sentence


def test_decode_matches_transfo_xl_tokenizer(pair):
    vocab, hf = pair
    for sentence in SENTENCES:
        ids = vocab.encode(sentence)
        assert vocab.decode(ids) == hf.decode(list(ids)), sentence


def test_numbers_and_dashes_are_split_and_joined_again(pair):
    vocab, _ = pair
    ids = vocab.encode("About 1,234,567 people live in the well-known city, 3.14 square miles")
    words = [vocab.symbols[i] for i in ids]
    assert words[:7] == ["About", "1", "@,@", "234", "@,@", "567", "people"]
    assert words[-5:] == ["3", "<unk>", "14", "square", "miles"]  # "@.@" is left out: <unk>
    assert words[words.index("well") + 1] == "@-@"
    assert vocab.decode(vocab.encode("About 1,234,567 people live in the well-known city")) == \
        "About 1,234,567 people live in the well-known city"


def test_lower_case_matches_the_oracle(tmp_path):
    subset = SENTENCES[:30]
    bare = oracle(tmp_path, ["<unk>", "<eos>"], lower_case=True)
    symbols = ["<unk>", "<eos>", *sorted({w for s in subset for w in bare.tokenize(s)})]
    hf = oracle(tmp_path, symbols, lower_case=True)
    vocab = Vocab(symbols, lower_case=True, never_split=hf.never_split)
    for sentence in subset:
        ids = vocab.encode(sentence)
        assert list(ids) == hf.convert_tokens_to_ids(hf.tokenize(sentence)), sentence
        assert vocab.decode(ids) == hf.decode(list(ids))


def test_lines_end_in_eos_and_decode_line_by_line(pair):
    vocab, hf = pair
    text = "\n".join(SENTENCES[:5]) + "\n"
    ids = vocab.encode(text)
    assert sum(vocab.symbols[i] == "<eos>" for i in ids) == 5
    assert vocab.decode(ids) == "".join(hf.decode(list(vocab.encode(s))) + "\n" for s in SENTENCES[:5])
    assert list(vocab.encode("a line")) == list(vocab.encode("a line", add_eos=True))  # unterminated: no <eos>


def pieces_of(vocab, ids):
    decoder = vocab.stream_decoder()
    return [decoder.feed(int(i)) for i in ids] + [decoder.flush()]


def assert_streams_exactly(vocab, ids):
    """The pieces join to `decode`, and what was printed after n tokens begins the text of every longer prefix:
    no later token changes a printed piece."""
    pieces = pieces_of(vocab, ids)
    assert "".join(pieces) == vocab.decode(ids)
    printed = ""
    for n, piece in enumerate(pieces[:-1]):
        printed += piece
        for m in range(n + 1, len(ids) + 1):
            assert vocab.decode(ids[:m]).startswith(printed), (list(ids[:m]), printed)


def test_stream_pieces_join_to_decode_for_every_sentence(pair):
    vocab, _ = pair
    text = "\n".join(SENTENCES) + "\n"
    ids = vocab.encode(text)
    assert "".join(pieces_of(vocab, ids)) == vocab.decode(ids)
    for sentence in SENTENCES[:40]:
        assert_streams_exactly(vocab, list(vocab.encode(sentence)))


PUNCTUATION_HEAVY = ["<unk>", "<eos>", "@-@", "@,@", "@.@", "1", "23", '"', "'", "'s", "n't", "(", ")", ",", ".",
                     "$", "%", "-", "--", "Jones", "it", "is", "東", "京", "&amp;", "?", "!", "[", "]", "``", "''",
                     "“", "”", "‘", "’", ";", ":"]


@pytest.fixture(scope="module")
def punctuation_heavy():
    return Vocab(PUNCTUATION_HEAVY)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, len(PUNCTUATION_HEAVY) - 1), max_size=14))
def test_random_streams_are_exact(punctuation_heavy, ids):
    assert_streams_exactly(punctuation_heavy, ids)


def test_stream_continuing_a_prompt(pair):
    vocab, _ = pair
    ids = list(vocab.encode("He said , it isn't over ."))
    decoder = vocab.stream_decoder(after="He")
    assert "".join(decoder.pieces(ids[1:])) == " said, it isn't over."
    # the prompt's ids as context: a number split across the prompt and the stream joins again
    number = list(vocab.encode("crowd of 45,000 cheered"))
    decoder = vocab.stream_decoder(after="crowd of 45", context=number[:3])
    assert "".join(decoder.pieces(number[3:])) == ",000 cheered"


def test_stream_continuing_text_it_was_not_shown(pair):
    vocab, _ = pair
    ids = [vocab.index[w] for w in (",", "it", "isn", "'t", "well", "@-@", "known", ".")]
    assert "".join(vocab.stream_decoder(after=CONTINUING).pieces(ids)) == ", it isn't well-known."
    # a dash generated after a prompt's word joins it
    dash = [vocab.index[w] for w in ("@-@", "known")]
    assert "".join(vocab.stream_decoder(after="the well").pieces(dash)) == "-known"


def test_decoded_unknown_ids_are_refused(pair):
    vocab, _ = pair
    with pytest.raises(Exception, match="outside the vocabulary"):
        vocab.decode(np.array([len(vocab)]))


@pytest.fixture
def small_window(monkeypatch):
    """The stream decoder's window at 3 words, so that it drops words (and seeds their quotes) many times a line."""
    from txl_deploy.vocab.stream import MosesLine

    monkeypatch.setattr(MosesLine, "WINDOW", 3)


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # the window patch is the same for all
@given(st.lists(st.integers(0, len(PUNCTUATION_HEAVY) - 1), min_size=6, max_size=40))
def test_random_streams_are_exact_when_the_window_drops_words(punctuation_heavy, small_window, ids):
    pieces = pieces_of(punctuation_heavy, ids)
    assert "".join(pieces) == punctuation_heavy.decode(ids)


def test_long_lines_stream_exactly_with_a_small_window(pair, small_window):
    vocab, _ = pair
    line = " ".join(SENTENCES)  # one line of every sentence: quotes opened and closed far apart
    ids = vocab.encode(line)
    assert "".join(pieces_of(vocab, ids)) == vocab.decode(ids)


def test_a_long_line_costs_a_window_per_word_not_the_line(punctuation_heavy):
    """Each word detokenizes at most a window of the line (plus the quote probes when words are dropped)."""
    from txl_deploy.vocab import moses
    from txl_deploy.vocab.stream import MosesLine

    sizes = []
    detokenize = moses.detokenize_line

    def counted(vocab, words):
        sizes.append(len(words))
        return detokenize(vocab, words)

    ids = [punctuation_heavy.index[w] for w in ["it", "is", "Jones", ",", "1", "23"] * 200]  # 1,200 words
    original, moses.detokenize_line = moses.detokenize_line, counted
    try:
        text = "".join(pieces_of(punctuation_heavy, ids))
    finally:
        moses.detokenize_line = original
    assert text == punctuation_heavy.decode(ids)
    assert max(sizes) <= 2 * MosesLine.WINDOW + 3
