"""The lm1b tokenizer. Reference: the One Billion Word benchmark's preparation scripts ran Moses'
normalize-punctuation.perl and tokenizer.perl -l en (no aggressive dash split, no escaping); here sacremoses is
called directly with those settings (MosesPunctNormalizer(lang="en").normalize, then MosesTokenizer(lang="en")
.tokenize(aggressive_dash_splits=False, escape=False)), and the original Transformer-XL data_utils put `<S>` before
and after each line's words (add_double_eos). Plus hand-written expectations."""

from __future__ import annotations

from pathlib import Path

import pytest
import sacremoses

from txl_deploy.vocab import Vocab

SENTENCES = (Path(__file__).parent / "data" / "word_sentences.txt").read_text(encoding="utf-8").splitlines()[:40]


def reference_words(line: str) -> list[str]:
    text = sacremoses.MosesPunctNormalizer(lang="en").normalize(line.strip())
    return sacremoses.MosesTokenizer(lang="en").tokenize(text, aggressive_dash_splits=False, escape=False)


@pytest.fixture(scope="module")
def lm1b():
    words = sorted({w for s in SENTENCES for w in reference_words(s)} - {"Zürich", "<S>", "</S>", "<UNK>"})
    return Vocab(["<S>", "</S>", "<UNK>", *words])


def test_detected_with_its_own_unknown_word_and_line_boundary(lm1b):
    assert (lm1b.tokenizer, lm1b.unk, lm1b.eos) == ("lm1b", "<UNK>", "<S>")
    assert Vocab.from_dict(lm1b.to_dict()) == lm1b


def test_ids_match_the_benchmarks_tokenization(lm1b):
    assert len(SENTENCES) >= 30
    for sentence in SENTENCES:
        expected = ["<S>", *reference_words(sentence), "<S>"]
        expected = [w if w in lm1b.index else "<UNK>" for w in expected]
        assert [lm1b.symbols[i] for i in lm1b.encode(sentence + "\n")] == expected, sentence


def test_hand_written_expectations(lm1b):
    words = [lm1b.symbols[i] for i in lm1b.encode("The well-known company's 1,500 men\n")]
    assert words == ["<S>", "The", "well-known", "company", "'s", "1,500", "men", "<S>"]  # no @-@, no @,@
    assert [lm1b.symbols[i] for i in lm1b.encode("Zürich's")] == ["<S>", "<UNK>", "'s"]  # an open line


def test_decode_puts_each_line_on_its_own(lm1b):
    text = "\n".join(SENTENCES[:6]) + "\n"
    ids = lm1b.encode(text)
    detok = sacremoses.MosesDetokenizer(lang="en")
    known = [[w if w in lm1b.index else "<UNK>" for w in reference_words(s)] for s in SENTENCES[:6]]
    assert lm1b.decode(ids) == "".join(detok.detokenize(words) + "\n" for words in known)
    assert lm1b.decode(lm1b.encode("it is\n")) == "it is\n"


def test_stream_pieces_join_to_decode(lm1b):
    ids = list(lm1b.encode("\n".join(SENTENCES) + "\n"))
    decoder = lm1b.stream_decoder()
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == lm1b.decode(ids)
    printed = ""
    for n, piece in enumerate(pieces[:60]):
        printed += piece
        assert lm1b.decode(ids[: n + 1 + 5]).startswith(printed)


def test_a_corpus_file_is_read_pre_tokenized_unless_raw(lm1b):
    corpus = "The company 's men\n\nit is\n"
    ids, counts = lm1b.encode_corpus(corpus.encode())
    assert [lm1b.symbols[i] for i in ids] == ["<S>", "The", "company", "'s", "men", "<S>", "<S>", "<S>",
                                              "<S>", "it", "is", "<S>"]
    assert "pre-tokenized" in counts["read_as"] and "<S>" in counts["line_ends"]
    raw_ids, raw_counts = lm1b.encode_corpus("The company's men\n", raw=True)
    assert [lm1b.symbols[i] for i in raw_ids] == ["<S>", "The", "company", "'s", "men", "<S>"]
    assert "lm1b tokenizer" in raw_counts["read_as"]
