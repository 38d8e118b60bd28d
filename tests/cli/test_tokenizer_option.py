"""`--tokenizer` on the command line, with a tiny model whose vocabulary is WikiText-103's kind (its own tokenizer:
wikitext, detected from the symbols): export and convert store the one given with the vocabulary; generate and eval
use it for that run only; eval reads a corpus file pre-tokenized unless told to tokenize raw text; a character model
has no word tokenizer to change."""

from __future__ import annotations

import json

import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.word_models import NATURAL_LINE, TOKENIZED_LINE, save_wikitext_model

from txl_deploy.assets import DEMO_DIR
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime

PROMPT = "the game was released in 2004"  # the same words for every tokenizer
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def wikitext_ckpt(tmp_path_factory):
    return save_wikitext_model(tmp_path_factory.mktemp("wikitext") / "model")


def test_convert_stores_the_tokenizer_given_and_keeps_the_vocabularys_own_otherwise(wikitext_ckpt, tmp_path):
    for tokenizer, expected in ((None, "wikitext"), ("whitespace", "whitespace")):
        out = tmp_path / f"converted-{tokenizer}"
        result = cli("convert", wikitext_ckpt, "-o", out, *(["--tokenizer", tokenizer] if tokenizer else []))
        assert result.exit_code == 0, result.output
        assert json.loads((out / "vocab.json").read_text())["tokenizer"] == expected
        with TxlRuntime.load(out) as rt:
            assert rt.vocab.tokenizer == expected


def test_export_stores_the_tokenizer_in_the_graphs_metadata(wikitext_ckpt, tmp_path):
    out = tmp_path / "ws.onnx"
    result = cli("export", wikitext_ckpt, "-o", out, "--tokenizer", "whitespace", "--no-verify", "--max-segment", "8")
    assert result.exit_code == 0, result.output
    with TxlRuntime.load(out) as rt:
        assert rt.vocab.tokenizer == "whitespace"
        assert rt.decode(rt.encode(NATURAL_LINE)) != NATURAL_LINE  # 2004, and year. are not words of it


def test_generate_prints_text_as_the_tokenizer_given_writes_it(wikitext_ckpt):
    with TxlRuntime.load(wikitext_ckpt) as rt:
        prompt_ids = [int(i) for i in rt.encode(PROMPT)]
        tokens = list(rt.generate(prompt_ids, NEW_TOKENS, temperature=1.0, seed=5))
        vocab = rt.vocab
    printed = {}
    for tokenizer in ("wikitext", "whitespace"):
        r = cli("generate", wikitext_ckpt, "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--seed", 5,
                *(["--tokenizer", tokenizer] if tokenizer != "wikitext" else []))
        assert r.exit_code == 0, r.output
        printed[tokenizer] = r.stdout
        assert r.stdout == vocab.with_tokenizer(tokenizer).decode(prompt_ids + tokens) + "\n"
    # the sample holds what the two write differently: the split markers and punctuation
    assert any(vocab.symbols[t] in ("@-@", "@,@", "@.@", ",", ".") for t in tokens)
    assert printed["wikitext"] != printed["whitespace"]
    assert " @,@ " not in printed["wikitext"] and " @-@ " not in printed["wikitext"]


def _eval(model, text_file, *options):
    r = cli("eval", model, "--text", text_file, "--json", text_file.with_suffix(".json"), *options)
    assert r.exit_code == 0, r.output
    return json.loads(text_file.with_suffix(".json").read_text())


def test_eval_reads_a_corpus_file_pre_tokenized_unless_told_to_tokenize_raw_text(wikitext_ckpt, tmp_path):
    tokenized, natural = tmp_path / "tokenized.txt", tmp_path / "natural.txt"
    tokenized.write_text(TOKENIZED_LINE + "\n" + TOKENIZED_LINE + "\n")
    natural.write_text(NATURAL_LINE + "\n" + NATURAL_LINE + "\n")
    as_corpus = _eval(wikitext_ckpt, tokenized)
    assert _eval(wikitext_ckpt, tokenized, "--tokenizer", "whitespace")["loss"] == as_corpus["loss"]
    raw = _eval(wikitext_ckpt, natural, "--tokenizer", "wikitext")
    # the natural text tokenized as WikiText-103 was is the corpus file's words: the same tokens, the same score
    assert raw["n_tokens"] == as_corpus["n_tokens"] and raw["loss"] == pytest.approx(as_corpus["loss"], abs=1e-6)
    # read as a corpus file, the natural text's "2004," and "year." are words the vocabulary lacks
    assert _eval(wikitext_ckpt, natural)["n_tokens"] < as_corpus["n_tokens"]


def test_a_character_model_has_no_word_tokenizer(tmp_path):
    r = cli("generate", DEMO_DIR / "kjv-char", "--prompt", "And", "--max-new-tokens", 1, "--tokenizer", "wikitext")
    assert_one_line_error(r, "--tokenizer wikitext", "char")


def test_serve_reads_and_writes_text_with_the_tokenizer_given(wikitext_ckpt, monkeypatch):
    from txl_deploy.serving.http import server

    engines = {}

    def serve(load_engine, settings, host, port):  # the engine the server would run, without a server
        engines[settings.model_name] = load_engine()

    monkeypatch.setattr(server, "serve", serve)
    for name, options in (("own", []), ("given", ["--tokenizer", "whitespace"])):
        r = cli("serve", wikitext_ckpt, "--model-name", name, *options)
        assert r.exit_code == 0, r.output
    assert {name: engine.vocab.tokenizer for name, engine in engines.items()} == {"own": "wikitext",
                                                                                 "given": "whitespace"}
    assert engines["given"].rt.vocab.tokenizer == "whitespace"  # the runtime's prompts are read the same way


def test_txlruntime_load_takes_the_tokenizer_as_the_command_line_does(wikitext_ckpt):
    with TxlRuntime.load(wikitext_ckpt) as own, TxlRuntime.load(wikitext_ckpt, tokenizer="whitespace") as split:
        assert own.vocab.tokenizer == "wikitext" and split.vocab.tokenizer == "whitespace"
        assert own.decode(own.encode(NATURAL_LINE)) == NATURAL_LINE  # Moses in, Moses out
        assert split.decode(own.encode(NATURAL_LINE)) == TOKENIZED_LINE  # the same ids, written as tokens
        split.set_tokenizer("wikitext")
        assert split.vocab == own.vocab
    with TxlRuntime.load(DEMO_DIR / "kjv-char") as chars:
        with pytest.raises(InputError, match="tokenizer wikitext: .*char"):
            chars.set_tokenizer("wikitext")
        assert chars.vocab.kind == "char"  # refused: the vocabulary is unchanged
