"""A word vocabulary's tokenizer and HuggingFace settings: detection, JSON round trip, another tokenizer, the
pre-tokenized corpus reading of `eval`, and the one-line error without sacremoses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from txl_deploy.errors import InputError
from txl_deploy.vocab import TOKENIZERS, Vocab, counting, detect_tokenizer

WIKITEXT = ["<unk>", "<eos>", "the", "well", "@-@", "known", "23", "@,@", "000", ",", "."]


def test_detect_tokenizer():
    assert TOKENIZERS == ("whitespace", "wikitext", "lm1b")
    assert detect_tokenizer(WIKITEXT) == "wikitext"
    assert detect_tokenizer(["<S>", "</S>", "<UNK>", "the"]) == "lm1b"
    assert detect_tokenizer(["<S>", "<eos>", "the"]) == "whitespace"
    assert Vocab(list("abc"), kind="char").tokenizer is None


def test_round_trip_keeps_the_settings():
    vocab = Vocab(WIKITEXT, tokenizer="wikitext", lower_case=True, delimiter=None, never_split=["<eos>", "<unk>"])
    d = vocab.to_dict()
    assert d["tokenizer"] == "wikitext" and d["lower_case"] is True and d["never_split"] == ["<eos>", "<unk>"]
    assert Vocab.from_dict(d) == vocab
    assert Vocab.from_dict(dict(d, lower_case=False)) != vocab
    assert "lower_case=True" in repr(vocab)


def test_an_old_dict_without_a_tokenizer_still_loads_and_is_detected():
    assert Vocab.from_dict({"kind": "word", "symbols": WIKITEXT}).tokenizer == "wikitext"
    assert Vocab.from_dict({"symbols": ["<eos>", "a", "b"]}).tokenizer == "whitespace"


def test_with_tokenizer_and_refusals():
    vocab = Vocab(WIKITEXT)
    plain = vocab.with_tokenizer("whitespace")
    assert plain.tokenizer == "whitespace" and plain != vocab and plain.symbols == vocab.symbols
    assert [plain.symbols[i] for i in plain.encode("the well-known")] == ["the", "<unk>"]
    with pytest.raises(ValueError, match="not one of"):
        Vocab(WIKITEXT, tokenizer="spacy")
    with pytest.raises(ValueError, match="no word tokenizer"):
        Vocab(list("ab"), kind="char").with_tokenizer("wikitext")


def test_eval_reads_a_pre_tokenized_corpus_as_the_original_pipeline():
    vocab = Vocab(WIKITEXT)
    corpus = "the well @-@ known 23 @,@ 000 .\n\nthe\n"
    ids, counts = vocab.encode_corpus(corpus.encode())
    assert [vocab.symbols[i] for i in ids] == ["the", "well", "@-@", "known", "23", "@,@", "000", ".", "<eos>",
                                               "<eos>", "the", "<eos>"]
    assert "pre-tokenized" in counting("word", counts, len(ids) - 1)
    raw, raw_counts = vocab.encode_corpus("the well-known 23,000.\n", raw=True)
    assert [vocab.symbols[i] for i in raw] == ["the", "well", "@-@", "known", "23", "@,@", "000", ".", "<eos>"]
    assert "raw text tokenized with the wikitext tokenizer" in counting("word", raw_counts, len(raw) - 1)


def test_without_sacremoses_the_package_imports_and_encode_names_the_extra():
    script = (
        "import sys; sys.modules['sacremoses'] = None\n"
        "from txl_deploy.errors import InputError\n"
        "from txl_deploy.vocab import Vocab\n"
        f"v = Vocab({WIKITEXT!r})\n"
        "assert list(v.with_tokenizer('whitespace').encode('the known')) == [2, 5]\n"
        "try:\n    v.encode('the well-known')\nexcept InputError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60)
    message = out.stdout.strip()
    assert "\n" not in message and "needs sacremoses: pip install " in message and "[text]'" in message


def test_the_error_is_an_input_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sacremoses", None)
    with pytest.raises(InputError, match=r"needs sacremoses: pip install .*\[text\]'"):
        Vocab(WIKITEXT).decode([2, 3])
