"""HuggingFace's TransfoXLTokenizer vocabularies (vocab.pkl, and vocab.bin, its torch.save twin) read without
running them: the file transformers' own `save_vocabulary` writes, the older plain-dict layout, vocab.bin in both
torch.save formats; found beside a HuggingFace folder (exported with that vocabulary), named by --vocab, and shown
by `info`. Malformed vocabularies are one-line errors naming the file and what is wrong."""

from __future__ import annotations

import json
import pickle
from collections import Counter, OrderedDict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from helpers.cli import assert_one_line_error, cli  # noqa: E402
from helpers.reference_models import WORDS, build_hf  # noqa: E402

from txl_deploy.checkpoints import load_model  # noqa: E402
from txl_deploy.checkpoints.vocab_files import VOCAB_FILES, find_vocab, open_vocab_file, read_vocab_file  # noqa: E402
from txl_deploy.contract.metadata import read_onnx_info  # noqa: E402
from txl_deploy.errors import CheckpointError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# A WikiText-103-like vocabulary: Moses' split markers and a hyphenated symbol kept whole.
SYMBOLS = ["<eos>", "<unk>", "the", "@-@", "@,@", "@.@", "cat", "state-of-the-art", "Café", ","]
OLD_LAYOUT_KEYS = ("idx2sym", "sym2idx", "counter", "special", "min_freq", "max_size", "lower_case", "delimiter",
                   "vocab_file", "never_split", "unk_idx")


def hf_tokenizer(tmp_path, symbols, **kwargs):
    """transformers' own TransfoXLTokenizer, built from a one-symbol-a-line file (the test oracle)."""
    from transformers.models.deprecated.transfo_xl import TransfoXLTokenizer  # the oracle (test extra)
    from transformers.utils import logging  # the oracle's deprecation warning is not what is tested

    logging.set_verbosity_error()
    words = tmp_path / "words-for-the-tokenizer.txt"
    words.write_text("".join(f"{s}\n" for s in symbols), encoding="utf-8")
    return TransfoXLTokenizer(vocab_file=str(words), **kwargs)


def saved_vocab_pkl(tmp_path, symbols=SYMBOLS, **kwargs):
    tok = hf_tokenizer(tmp_path, symbols, **kwargs)
    (path,) = tok.save_vocabulary(str(tmp_path))
    return tok, Path(path)


def old_layout(tok) -> dict:
    """The plain dict pytorch-pretrained-bert's TransfoXLTokenizer pickled: its data attributes only."""
    return {k: tok.__dict__[k] for k in OLD_LAYOUT_KEYS}


def test_a_vocabulary_written_by_transformers_save_vocabulary_loads(tmp_path):
    tok, path = saved_vocab_pkl(tmp_path, never_split=["state-of-the-art"], lower_case=True)
    assert "moses_tokenizer" in pickle.loads(path.read_bytes())  # what makes the file dangerous to unpickle
    vocab = read_vocab_file(path)
    assert vocab.symbols == tok.idx2sym == SYMBOLS
    assert vocab.kind == "word" and vocab.tokenizer == "wikitext"
    assert vocab.lower_case is True and vocab.delimiter is None
    assert tuple(vocab.never_split) == ("state-of-the-art",)
    assert vocab.unk == "<unk>" and vocab.eos == "<eos>"
    assert "save_vocabulary" in open_vocab_file(path).format and "read without running it" in \
        open_vocab_file(path).format


SENTENCES = ["The cat is state-of-the-art, 1,000 of 2.5 cats.", "Café \"the\" cat , state of the art",
             "THE CAT 2.5 1,000 state-of-the-art"]


@pytest.mark.parametrize("lower_case", [False, True])
def test_text_is_read_and_written_as_the_tokenizer_that_saved_the_file_does(tmp_path, lower_case):
    """The settings the file carries (lower_case, never_split) make our ids and text those of the tokenizer that
    wrote it, the oracle."""
    symbols = [*SYMBOLS, "of", "art", "cats", "1", "000", "2", "5", "is", ".", "\"", "The", "THE", "CAT"]
    tok, path = saved_vocab_pkl(tmp_path, symbols=symbols, never_split=["state-of-the-art"], lower_case=lower_case)
    vocab = read_vocab_file(path)
    for sentence in SENTENCES:
        ids = tok.convert_tokens_to_ids(tok.tokenize(sentence))
        assert [int(i) for i in vocab.encode(sentence, add_eos=False)] == ids, sentence
        assert vocab.decode(ids) == tok.decode(ids), sentence
    assert vocab.symbols.index("state-of-the-art") in ids  # kept whole, as never_split says


def test_the_old_plain_dict_layout_loads_in_every_pickle_protocol(tmp_path):
    tok = hf_tokenizer(tmp_path, SYMBOLS, lower_case=False)
    for protocol in (0, 2, 4):
        path = tmp_path / f"vocab-{protocol}.pkl"
        path.write_bytes(pickle.dumps(old_layout(tok), protocol=protocol))
        vocab = read_vocab_file(path)
        assert vocab.symbols == SYMBOLS and vocab.tokenizer == "wikitext" and vocab.lower_case is False
        assert "plain dict" in open_vocab_file(path).format
    # without never_split, the special tokens transformers' tokenizer keeps whole by default
    bare = {k: v for k, v in old_layout(tok).items() if k != "never_split"}
    (tmp_path / "bare.pkl").write_bytes(pickle.dumps(bare))
    assert set(read_vocab_file(tmp_path / "bare.pkl").never_split) == {"<eos>", "<unk>", "<formula>"}


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_vocab_bin_the_torch_save_twin_loads(tmp_path, zip_format):
    tok = hf_tokenizer(tmp_path, SYMBOLS, lower_case=True)
    path = tmp_path / "vocab.bin"
    torch.save(old_layout(tok), path, _use_new_zipfile_serialization=zip_format)
    vocab = read_vocab_file(path)
    assert vocab.symbols == SYMBOLS and vocab.lower_case is True and vocab.tokenizer == "wikitext"
    assert "torch.save" in open_vocab_file(path).format


def test_lm1b_symbols_give_the_lm1b_tokenizer_and_its_unk(tmp_path):
    symbols = ["<S>", "</S>", "<UNK>", "the", "cat", "."]
    tok = hf_tokenizer(tmp_path, symbols)
    path = tmp_path / "lm1b.pkl"
    path.write_bytes(pickle.dumps(old_layout(tok)))
    vocab = read_vocab_file(path)
    assert vocab.tokenizer == "lm1b" and vocab.unk == "<UNK>" and vocab.symbols == symbols
    # the user's word for the tokenizer wins
    assert read_vocab_file(path, tokenizer="whitespace").tokenizer == "whitespace"


def test_a_python_2_layout_of_bytes_is_read_as_utf8_text(tmp_path):
    """A Python 2 pickle's str come back as bytes (read with encoding="bytes"): keys and symbols are the UTF-8 text
    the vocabulary file held, so "Café" is not mojibake."""
    symbols = [s.encode("utf-8") for s in SYMBOLS]
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps({b"idx2sym": symbols, b"sym2idx": {s: i for i, s in enumerate(symbols)},
                                   b"unk_idx": 1, b"delimiter": None}, protocol=2))
    assert read_vocab_file(path).symbols == SYMBOLS


def test_a_sym2idx_only_vocabulary_is_read_in_id_order(tmp_path):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps({"sym2idx": OrderedDict((s, i) for i, s in enumerate(SYMBOLS)),
                                   "counter": Counter(), "unk_idx": 1}))
    assert read_vocab_file(path).symbols == SYMBOLS


@pytest.mark.parametrize("change, problem", [
    (lambda d: d["sym2idx"].update(the=6, cat=2), "sym2idx disagrees with idx2sym: 'the' is 6 in sym2idx but 2"),
    (lambda d: d.update(idx2sym="the cat"), "idx2sym is of type str, not a list of symbols"),
    (lambda d: d.update(idx2sym=[*d["idx2sym"][:-1], 7]), "idx2sym holds a value of type int"),
    (lambda d: d.update(unk_idx=len(SYMBOLS)), f"unk_idx {len(SYMBOLS)} is not an id"),
    (lambda d: d.update(lower_case="yes"), "lower_case is of type str"),
    (lambda d: d.update(never_split=5), "never_split is of type int"),
    (lambda d: d.update(idx2sym=[*d["idx2sym"], "the"], sym2idx=None), "duplicate symbol 'the'"),
    (lambda d: d.update(idx2sym=[], sym2idx=None), "vocabulary is empty"),
], ids=["disagreeing-sym2idx", "idx2sym-str", "non-text-symbol", "unk-out-of-range", "lower-case-str",
        "never-split-int", "duplicate", "empty"])
def test_a_malformed_vocabulary_is_a_one_line_error_naming_the_problem(tmp_path, change, problem):
    d = old_layout(hf_tokenizer(tmp_path, SYMBOLS))
    change(d)
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(d))
    with pytest.raises(CheckpointError) as err:
        read_vocab_file(path)
    assert problem in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)


def test_a_pickle_that_is_not_a_vocabulary_says_what_it_holds(tmp_path):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps({"weights": [1, 2]}))
    with pytest.raises(CheckpointError, match="is a pickle but not a vocabulary .it holds a dict with keys weights"):
        read_vocab_file(path)


def hf_folder(hf, tmp_path):
    folder = tmp_path / "hf"
    build_hf(hf, untie_r=True, same_length=True).save_pretrained(folder)
    return folder


def test_a_huggingface_folder_gets_its_vocab_pkl_and_exports_with_it(hf, tmp_path):
    folder = hf_folder(hf, tmp_path)
    tok, _ = saved_vocab_pkl(folder, symbols=WORDS)
    assert find_vocab(folder) == folder / "vocab.pkl"
    loaded = load_model(folder)
    assert loaded.vocab.symbols == WORDS == tok.idx2sym and loaded.vocab.tokenizer == "wikitext"
    assert loaded.vocab_source == str(folder / "vocab.pkl") and "read without running it" in loaded.vocab_format
    # info says where the vocabulary came from, what the file is, and its tokenizer
    result = cli("info", folder)
    assert result.exit_code == 0, result.output
    assert f"from:      {folder / 'vocab.pkl'}: vocab.pkl (transformers' TransfoXLTokenizer.save_vocabulary" in \
        result.output and "tokenizer: wikitext" in result.output
    d = json.loads(cli("info", folder, "--json").output)
    assert d["vocab_source"] == str(folder / "vocab.pkl") and d["vocab_tokenizer"] == "wikitext"
    # the export carries that vocabulary in its metadata
    result = cli("export", folder, "-o", tmp_path / "hf.onnx", "--no-verify", "--max-segment", 8)
    assert result.exit_code == 0, result.output
    exported = read_onnx_info(tmp_path / "hf.onnx").vocab
    assert exported.symbols == WORDS and exported.tokenizer == "wikitext"


def test_vocab_option_takes_a_vocab_pkl_and_the_search_order_holds(hf, tmp_path):
    folder = hf_folder(hf, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    saved_vocab_pkl(elsewhere, symbols=WORDS, lower_case=True)
    loaded = load_model(folder, vocab=elsewhere / "vocab.pkl")
    assert loaded.vocab.symbols == WORDS and loaded.vocab.lower_case is True
    assert load_model(folder, vocab=elsewhere / "vocab.pkl", tokenizer="whitespace").vocab.tokenizer == "whitespace"
    # beside the model: vocab.json, vocab.txt, vocab.pkl, vocab.bin, cache.pt, the music event dictionaries, the
    # first one found
    assert VOCAB_FILES == ("vocab.json", "vocab.txt", "vocab.pkl", "vocab.bin", "cache.pt", "dictionary.pkl",
                           "vocab_song_artist.pkl")
    tok = hf_tokenizer(tmp_path, WORDS)
    torch.save(old_layout(tok), folder / "vocab.bin")
    assert find_vocab(folder) == folder / "vocab.bin"
    (folder / "vocab.pkl").write_bytes(pickle.dumps(old_layout(tok)))
    assert find_vocab(folder) == folder / "vocab.pkl"
    (folder / "vocab.txt").write_text("".join(f"{w}\n" for w in WORDS))
    assert find_vocab(folder) == folder / "vocab.txt"
    assert load_model(folder).vocab_source == str(folder / "vocab.txt")
    # a vocabulary of the wrong size is refused, naming the file
    short = tmp_path / "short.pkl"
    short.write_bytes(pickle.dumps({"idx2sym": WORDS[:5]}))
    assert_one_line_error(cli("info", folder, "--vocab", short), "short.pkl", "5 symbols", f"n_token={len(WORDS)}")
