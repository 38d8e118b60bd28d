"""The kind of a vocabulary (bytes for enwik8, text8), detected for every checkpoint format the paper's character
models come in: the original TensorFlow checkpoints (written by TensorFlow's own Saver, tensorflow-cpu being the
test oracle), the original PyTorch code's `model.pt` with its corpus `cache.pt`, and NVIDIA's checkpoints. The
kind comes from the corpus's name, from the symbols, or from `--vocab-kind`; `info` shows it, and it travels in
`vocab.json` and in the ONNX metadata, so the .onnx file alone is enough."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest
from helpers import character_corpora as cc
from helpers.cli import assert_one_line_error, cli

from txl_deploy.checkpoints import load_model
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.errors import CheckpointError

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def enwik8(enwik8_cycle):
    return enwik8_cycle


@pytest.fixture(scope="module")
def text8():
    return cc.text8_model()


# -- the original TensorFlow checkpoints ---------------------------------------------------------------------------
def test_tf_checkpoint_converts_with_its_corpus_kind_and_info_shows_it(tf_enwik8, tf_enwik8_onnx, enwik8, tmp_path):
    symbols = enwik8[0]
    out = tmp_path / "enwik8"
    result = cli("convert", tf_enwik8, "-o", out, "--config", tf_enwik8 / "flags.json")
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "vocab.json").read_text())
    assert saved == {"kind": "bytes", "symbols": symbols}
    result = cli("info", tf_enwik8, "--config", tf_enwik8 / "flags.json")
    assert result.exit_code == 0, result.output
    assert f"vocabulary:  {len(symbols)} symbols, kind bytes: UTF-8 bytes as decimal symbols (enwik8); newlines " \
           "dropped" in result.output
    # the ONNX file alone says the kind (exported from the TF folder with no vocabulary flags): its metadata
    assert read_onnx_info(tf_enwik8_onnx).vocab == load_model(out).vocab
    assert read_onnx_info(tf_enwik8_onnx).vocab.kind == "bytes"
    result = cli("info", tf_enwik8_onnx, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["vocab_kind"] == "bytes"


def test_the_kind_comes_from_corpus_info_json_or_from_the_symbols(tf_enwik8, enwik8, tmp_path):
    symbols = enwik8[0]
    root = tmp_path / "tf_enwik8"
    shutil.copytree(tf_enwik8, root)
    # a cache that does not name its corpus: corpus-info.json's dataset decides
    (root / "data" / "cache.pkl").write_bytes(cc.tf_cache_pkl(symbols, ""))
    assert load_model(root, config=root / "flags.json").vocab.kind == "bytes"
    # neither names it: the symbols, all decimal byte values, do
    info = json.loads((root / "data" / "corpus-info.json").read_text())
    (root / "data" / "corpus-info.json").write_text(json.dumps({**info, "dataset": "mine"}))
    assert load_model(root, config=root / "flags.json").vocab.kind == "bytes"
    # the user's word wins
    loaded = load_model(root, config=root / "flags.json", vocab_kind="word")
    assert loaded.vocab.kind == "word" and loaded.vocab.symbols == symbols
    result = cli("convert", root, "-o", tmp_path / "w", "--config", root / "flags.json", "--vocab-kind", "word")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "w" / "vocab.json").read_text())["kind"] == "word"
    assert_one_line_error(cli("convert", root, "-o", tmp_path / "t8", "--config", root / "flags.json",
                              "--vocab-kind", "text8"),
                          "cache.pkl", "cannot be a text8 vocabulary", f"symbol '{symbols[0]}'")
    assert not (tmp_path / "t8").exists()


def test_a_corpus_name_that_contradicts_the_symbols_is_an_error(tf_enwik8, tmp_path):
    root = tmp_path / "tf_text8"
    shutil.copytree(tf_enwik8, root)
    words = [f"w{i}" for i in range(len(cc.enwik8_model()[0]))]
    (root / "data" / "cache.pkl").write_bytes(cc.tf_cache_pkl(words, "text8"))
    with pytest.raises(CheckpointError, match="its corpus is text8, whose vocabulary is of kind text8, but symbol "
                                              "'w0' is not a lowercase letter"):
        load_model(root, config=root / "flags.json")


def test_tf_text8_checkpoint(text8, tmp_path):
    symbols, _, weights, hp = text8
    root = cc.write_tf_published(tmp_path / "tf_text8", weights, hp, symbols, "text8")
    loaded = load_model(root, config=root / "flags.json")
    assert loaded.vocab.kind == "text8" and loaded.vocab.symbols == symbols


# -- the original PyTorch code: model.pt and its corpus cache.pt ----------------------------------------------------
@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_pytorch_model_pt_with_its_corpus_cache(enwik8, text8, tmp_path, legacy):
    symbols, _, weights, hp = enwik8
    cc.write_original_model_pt(tmp_path / "model.pt", weights, hp, legacy=legacy)
    cache = tmp_path / "data" / "cache.pt"
    cache.parent.mkdir()
    cc.write_torch_cache(cache, symbols, "enwik8", legacy=legacy)
    loaded = load_model(tmp_path / "model.pt", vocab=cache)
    assert loaded.source_format == "cmu" and loaded.vocab.kind == "bytes" and loaded.vocab.symbols == symbols
    # the corpus cache beside the model is found, as vocab.txt / vocab.json are
    shutil.copy(cache, tmp_path / "cache.pt")
    assert load_model(tmp_path / "model.pt").vocab.kind == "bytes"
    out = tmp_path / "converted"
    result = cli("convert", tmp_path / "model.pt", "-o", out)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "vocab.json").read_text())["kind"] == "bytes"
    # text8's cache
    t_symbols, _, t_weights, t_hp = text8
    cc.write_original_model_pt(tmp_path / "text8.pt", t_weights, t_hp, legacy=legacy)
    cc.write_torch_cache(tmp_path / "text8-cache.pt", t_symbols, "text8", legacy=legacy)
    assert load_model(tmp_path / "text8.pt", vocab=tmp_path / "text8-cache.pt").vocab.kind == "text8"


def test_a_vocab_txt_of_byte_values_is_bytes_and_a_malicious_cache_pt_runs_nothing(enwik8, tmp_path):
    symbols, _, weights, hp = enwik8
    cc.write_original_model_pt(tmp_path / "model.pt", weights, hp)
    (tmp_path / "vocab.txt").write_text("".join(f"{s}\n" for s in symbols))
    assert load_model(tmp_path / "model.pt").vocab.kind == "bytes"
    marker = tmp_path / "marker"
    evil = tmp_path / "evil.pt"
    evil.write_bytes(b"cos\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")
    assert_one_line_error(cli("info", tmp_path / "model.pt", "--vocab", evil), "evil.pt",
                          "refused to unpickle os.system")
    # inside a real torch.save archive: refused by name before anything runs
    torch.save({"x": 1}, evil)
    with zipfile.ZipFile(evil) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    data_pkl = next(n for n in entries if n.endswith("data.pkl"))
    entries[data_pkl] = b"\x80\x02cposix\nsystem\nX" + bytes([len(f"touch {marker}")]) + b"\x00\x00\x00" + \
        f"touch {marker}".encode() + b"\x85R."
    with zipfile.ZipFile(evil, "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)
    assert_one_line_error(cli("info", tmp_path / "model.pt", "--vocab", evil), "refused to unpickle posix.system",
                          "nothing from the file was run")
    assert not marker.exists()


# -- NVIDIA ------------------------------------------------------------------------------------------------------
def test_nvidia_checkpoint_kind_from_its_dataset(enwik8, text8, tmp_path):
    symbols, _, weights, hp = enwik8
    cc.write_nvidia_checkpoint(tmp_path / "enwik8.pt", weights, hp, symbols, dataset="enwik8")
    loaded = load_model(tmp_path / "enwik8.pt")
    assert loaded.source_format == "nvidia" and loaded.vocab.kind == "bytes"
    t_symbols, _, t_weights, t_hp = text8
    cc.write_nvidia_checkpoint(tmp_path / "text8.pt", t_weights, t_hp, t_symbols, dataset="text8")
    assert load_model(tmp_path / "text8.pt").vocab.kind == "text8"
    # a word-level corpus keeps its words
    words = [f"w{i}" for i in range(len(symbols))]
    cc.write_nvidia_checkpoint(tmp_path / "wt103.pt", weights, hp, words, dataset="wt103")
    assert load_model(tmp_path / "wt103.pt").vocab.kind == "word"


# -- a model converted before the kinds existed ----------------------------------------------------------------------
def test_a_stored_word_kind_with_byte_symbols_gets_a_note_and_export_can_fix_it(enwik8, tmp_path):
    symbols, _, weights, hp = enwik8
    cc.write_original_model_pt(tmp_path / "model.pt", weights, hp)
    (tmp_path / "vocab.txt").write_text("".join(f"{s}\n" for s in symbols))
    old = tmp_path / "old"
    assert cli("convert", tmp_path / "model.pt", "-o", old, "--vocab-kind", "word").exit_code == 0
    assert json.loads((old / "vocab.json").read_text())["kind"] == "word"
    result = cli("info", old)
    assert "note: the vocabulary is stored as kind word, but its symbols are those of a bytes vocabulary" in \
           result.output and "--vocab-kind bytes" in result.output
    # `export --vocab-kind bytes` writes the vocabulary into the graph's metadata as bytes
    fixed = tmp_path / "fixed.onnx"
    result = cli("export", old, "-o", fixed, "--vocab-kind", "bytes", "--no-verify", "--max-segment", 8,
                 "--skip-memory-check")
    assert result.exit_code == 0, result.output
    vocab = read_onnx_info(fixed).vocab
    assert vocab.kind == "bytes" and vocab.symbols == symbols
    result = cli("info", fixed, "--json")
    assert result.exit_code == 0 and json.loads(result.output)["vocab_kind"] == "bytes"
