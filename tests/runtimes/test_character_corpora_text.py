"""Text in and out of the paper's character models, on checkpoints written by the original TensorFlow code (exported
to ONNX, run by ONNX Runtime) and by the original PyTorch pipeline (`model.pt` + `cache.pt`, run by the PyTorch
reference): UTF-8 round trips for enwik8's bytes, text8's `_` for the space, generation that prints valid text
(a character spelled over several byte tokens appears once whole), and `eval --text` on raw text scoring exactly
the symbol stream the original preprocessing makes of that text.

The models are `helpers.character_corpora.cycle_model`s: their greedy continuation is known in advance."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from helpers import character_corpora as cc
from helpers.cli import assert_one_line_error, cli

from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.evaluation import streaming_eval

pytest.importorskip("torch")

@pytest.fixture(scope="module")
def pytorch_enwik8(enwik8_cycle, tmp_path_factory):
    """The original PyTorch pipeline's files: LM-TFM-enwik8/model.pt, and data/enwik8/cache.pt passed as --vocab."""
    symbols, _, weights, hp = enwik8_cycle
    root = tmp_path_factory.mktemp("pytorch")
    (root / "LM-TFM-enwik8").mkdir()
    (root / "data" / "enwik8").mkdir(parents=True)
    cc.write_original_model_pt(root / "LM-TFM-enwik8" / "model.pt", weights, hp)
    cc.write_torch_cache(root / "data" / "enwik8" / "cache.pt", symbols, "enwik8")
    converted = root / "enwik8"
    result = cli("convert", root / "LM-TFM-enwik8" / "model.pt", "--vocab", root / "data" / "enwik8" / "cache.pt",
                 "-o", converted)
    assert result.exit_code == 0, result.output
    return converted


@pytest.fixture(scope="module")
def text8_models(tmp_path_factory):
    """text8 as the original PyTorch pipeline leaves it (model.pt with cache.pt beside it) and as the TensorFlow
    checkpoint, converted: {name: model path}."""
    symbols, successor, weights, hp = cc.text8_model()
    root = tmp_path_factory.mktemp("text8")
    cc.write_original_model_pt(root / "model.pt", weights, hp)
    cc.write_torch_cache(root / "cache.pt", symbols, "text8")
    out = {"pytorch": root / "model.pt"}
    tf_root = cc.write_tf_published(root / "tf_text8", weights, hp, symbols, "text8")
    result = cli("convert", tf_root, "--config", tf_root / "flags.json", "-o", root / "tf-converted")
    assert result.exit_code == 0, result.output
    out["tensorflow"] = root / "tf-converted"
    return out, symbols, successor


@pytest.fixture(scope="module", params=["tensorflow-onnx", "pytorch"])
def enwik8_model(request, tf_enwik8_onnx, pytorch_enwik8):
    return tf_enwik8_onnx if request.param == "tensorflow-onnx" else pytorch_enwik8


# -- round trips -------------------------------------------------------------------------------------------------
def test_utf8_round_trip_with_non_ascii_text(enwik8_model, enwik8_cycle):
    symbols = enwik8_cycle[0]
    text = "Zürich — 東京, naïve café ✓ déjà vu"
    with TxlRuntime.load(enwik8_model, threads=1) as rt:
        assert rt.vocab.kind == "bytes"
        ids = rt.encode(text)
        assert [symbols[i] for i in ids] == [str(b) for b in text.encode("utf-8")]
        assert rt.decode(ids) == text
        assert rt.decode(rt.encode("<page>\n  <title>")) == "<page>  <title>"  # newlines dropped, as in training


def test_text8_round_trip(text8_models):
    models, symbols, _ = text8_models
    for path in models.values():
        with TxlRuntime.load(path, threads=1) as rt:
            assert rt.vocab.kind == "text8" and rt.vocab.symbols == symbols
            ids = rt.encode("the lazy dog jumps")
            assert "".join(symbols[i] for i in ids) == "the_lazy_dog_jumps"
            assert rt.decode(ids) == "the lazy dog jumps"


# -- generation ------------------------------------------------------------------------------------------------
def test_generation_prints_valid_text_with_characters_split_over_tokens(enwik8_model, enwik8_cycle):
    successor = enwik8_cycle[1]
    n = 24  # the last character is cut: its bytes never print as garbage, the end of the stream says U+FFFD
    want = cc.greedy_bytes_text(successor, "a", n)
    assert want == "bcé€ж日 abcé€ж\ufffd"  # 24 bytes: the first of 日's three ends the stream
    result = cli("generate", enwik8_model, "--prompt", "a", "--max-new-tokens", n, "--temperature", 0,
                 "--threads", 1)
    assert result.exit_code == 0, result.output
    assert result.stdout == "a" + want + "\n"
    with TxlRuntime.load(enwik8_model, threads=1) as rt:
        pieces = list(rt.generate_text("a", max_new_tokens=n, temperature=0))
    # a character arrives once, whole: the pieces are exactly the characters (then the replaced incomplete tail)
    assert pieces == list("bcé€ж日 abcé€ж") + ["\ufffd"]


def test_a_byte_the_model_never_saw_is_a_clear_error(enwik8_model):
    assert_one_line_error(cli("generate", enwik8_model, "--prompt", "Ω", "--max-new-tokens", 3),
                          "byte 206 (0xce, of 'Ω' at byte 0) is not in this model's byte vocabulary")


def test_text8_generation_and_refusals(text8_models):
    models, _, successor = text8_models
    want = "".join(" " if s == "_" else s for s in cc.greedy_symbols(successor, "k", 14))
    assert want == " brownquick br"  # the cycle: "quick brown" over and over
    for path in models.values():
        result = cli("generate", path, "--prompt", "the quick", "--max-new-tokens", 14, "--temperature", 0)
        assert result.exit_code == 0, result.output
        assert result.stdout == "the quick" + want + "\n"
        assert_one_line_error(cli("generate", path, "--prompt", "The quick", "--max-new-tokens", 1),
                              "character 'T' is not in this text8 vocabulary, which holds lowercase a-z and spaces "
                              "only")


# -- evaluation ----------------------------------------------------------------------------------------------------
def original_ids(symbols, split_txt):
    """The ids the original data_utils.py feeds its model for a preprocessed split (vocab.encode_file)."""
    index = {s: i for i, s in enumerate(symbols)}
    return np.array([index[s] for s in cc.read_symbols(split_txt)], dtype=np.int64)


def oracle_eval(model, ids, tgt_len):
    with TxlRuntime.load(model, threads=1) as rt:
        return streaming_eval(ids, rt.step, tgt_len)


def test_eval_text_on_enwik8_equals_the_original_preprocessing(enwik8_model, enwik8_cycle, tmp_path):
    symbols = enwik8_cycle[0]
    raw = (cc.ENWIK8_TRAIN * 3)[18:]  # a split that starts inside 'ü', as the last 5M bytes of enwik8 may
    assert raw[:1] == b"\xbc" and raw.count(b"\n") == 11
    (tmp_path / "test.txt.raw").write_bytes(raw)
    result = cli("eval", enwik8_model, "--text", tmp_path / "test.txt.raw", "--tgt-len", 8, "--threads", 1,
                 "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    got = json.loads((tmp_path / "r.json").read_text())
    ids = original_ids(symbols, cc.enwik8_split_txt(raw))
    want = oracle_eval(enwik8_model, ids, 8)
    assert got["n_tokens"] == want["n_tokens"] == len(raw) - raw.count(b"\n") - 1
    assert got["nll"] == pytest.approx(want["nll"], rel=1e-12, abs=1e-9)
    assert got["bits_per_token"] == pytest.approx(want["bits_per_token"], rel=1e-12)
    assert got["unit"] == "bpc" and got["counted"] == "bytes"
    assert got["input"] == {"raw_bytes": len(raw), "newlines": 11, "newlines_are": "dropped", "symbols": len(ids)}
    assert "newline bytes (dropped by the original enwik8 preprocessing, so never predicted)" in got["counting"]
    assert f"bits per byte (bpc)            {got['bits_per_token']:.4f}" in result.output


def test_eval_text_on_text8_equals_the_original_preprocessing(text8_models, tmp_path):
    models, symbols, _ = text8_models
    raw = cc.TEXT8_TRAIN * 3  # starts with a space, as text8 does: prep_text8.py strips it
    (tmp_path / "test.txt.raw").write_text(raw)
    ids = original_ids(symbols, cc.text8_split_txt(raw))
    assert len(ids) == len(raw) - 1
    for path in models.values():
        result = cli("eval", path, "--text", tmp_path / "test.txt.raw", "--tgt-len", 8, "--threads", 1,
                     "--json", tmp_path / "r.json")
        assert result.exit_code == 0, result.output
        got = json.loads((tmp_path / "r.json").read_text())
        want = oracle_eval(path, ids, 8)
        assert got["n_tokens"] == want["n_tokens"] == len(ids) - 1
        assert got["nll"] == pytest.approx(want["nll"], rel=1e-12, abs=1e-9)
        assert got["counted"] == "characters" and got["input"]["stripped"] == 1
        assert "bits per character" in result.output


def test_the_minimal_example_driver_reads_the_kind_from_the_file_alone(tf_enwik8_onnx, tmp_path):
    """examples/onnxruntime_driver.py (numpy and onnxruntime only) writes the same text from the .onnx file alone,
    and refuses a kind it does not know rather than reading it as words."""
    driver = Path(__file__).resolve().parents[2] / "examples" / "onnxruntime_driver.py"
    run = (lambda model: subprocess.run([sys.executable, str(driver), str(model), "--prompt", "a",
                                         "--max-new-tokens", "24"], capture_output=True, text=True, timeout=120))
    r = run(tf_enwik8_onnx)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "abcé€ж日 abcé€ж\ufffd\n"
    model = onnx.load(str(tf_enwik8_onnx))
    entry = next(p for p in model.metadata_props if p.key == "txl_deploy.vocab")
    entry.value = json.dumps({**json.loads(entry.value), "kind": "bpe"})
    onnx.save(model, str(tmp_path / "future.onnx"))
    r = run(tmp_path / "future.onnx")
    assert r.returncode == 2 and "vocabulary kind 'bpe' is not one this driver knows" in r.stderr
    # and txl-deploy itself says to upgrade
    message = assert_one_line_error(cli("generate", tmp_path / "future.onnx", "--prompt", "a"),
                                    "vocabulary kind 'bpe' is not one this txl-deploy knows", "upgrade txl-deploy")
    assert "corrupt" not in message
