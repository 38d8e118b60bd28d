"""`txl-deploy convert` and `info` on checkpoints: bad input (not a checkpoint, truncated, a torch file of something
else, shapes that contradict the config, a missing or mismatched vocabulary) is a one-line error naming the file;
convert never overwrites without --force; info reports the format, config, parameters, vocabulary and memory.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from helpers.cli import assert_one_line_error, cli  # noqa: E402
from helpers.reference_models import (  # noqa: E402
    CMU_VARIANTS,
    D_INNER,
    D_MODEL,
    MEM_LEN,
    N_LAYER,
    WORDS,
    V,
    kwargs_of,
    make_our_model,
    save_our_model_as_model_pt,
    write_vocab_txt,
)

from txl_deploy.checkpoints import load_model  # noqa: E402
from txl_deploy.errors import CheckpointError  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- bad input ---------------------------------------------------------------------------------------------
@pytest.fixture
def cmu_checkpoint(tmp_path):
    save_our_model_as_model_pt(tmp_path / "model.pt", **CMU_VARIANTS["div2"])
    return tmp_path / "model.pt"


def test_random_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "random.bin"
    path.write_bytes(bytes(range(256)) * 8)
    assert_one_line_error(cli("info", path), path, "not a checkpoint of a supported format")
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    assert_one_line_error(cli("convert", text, "-o", tmp_path / "out"), text, "not a checkpoint")
    assert_one_line_error(cli("info", tmp_path / "missing.pt"), "missing.pt", "does not exist")
    (tmp_path / "folder").mkdir()
    assert_one_line_error(cli("info", tmp_path / "folder"), "folder", "neither a txl-deploy checkpoint")


@pytest.mark.parametrize("legacy", [False, True])
def test_truncated_checkpoint(cmu_checkpoint, tmp_path, legacy):
    source = cmu_checkpoint
    if legacy:
        source = tmp_path / "legacy.pt"
        torch.save(load_model(cmu_checkpoint).state_dict, source, _use_new_zipfile_serialization=False)
    data = source.read_bytes()
    cut = tmp_path / "cut.pt"
    cut.write_bytes(data[: len(data) // 2])
    assert_one_line_error(cli("info", cut), cut, "truncated or corrupt")


def test_torch_file_of_something_else(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"epoch": 3, "note": "not a model"}, path)
    assert_one_line_error(cli("info", path), path, "not a Transformer-XL checkpoint", "epoch")
    linear = tmp_path / "linear.pt"
    torch.save(torch.nn.Linear(2, 3).state_dict(), linear)
    (tmp_path / "linear.json").write_text(json.dumps(dict(n_token=V, n_layer=1, n_head=1, d_model=4, d_head=4,
                                                          d_inner=8)))
    assert_one_line_error(cli("info", linear), linear, "'weight' is not part of a CMU")


def test_shapes_contradicting_the_config(tmp_path):
    model = make_our_model(**CMU_VARIANTS["div2"])
    torch.save(model.state_dict(), tmp_path / "weights.pt")
    config = dict(kwargs_of(model.cfg), d_inner=2 * D_INNER)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    message = assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.pt", "has shape", "config implies")
    assert "pos_ff.CoreNet" in message
    config.update(d_inner=D_INNER, n_layer=3)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.pt", "layers.2", "missing")
    config.update(n_layer=N_LAYER, dropout_rate=0.1)
    (tmp_path / "weights.json").write_text(json.dumps(config))
    assert_one_line_error(cli("info", tmp_path / "weights.pt"), "weights.json", "unknown CMU config keys: dropout_rate")


def test_missing_and_mismatched_vocabulary(cmu_checkpoint, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(cli("convert", cmu_checkpoint, "-o", out), "model.pt", "no vocabulary", "--vocab")
    assert not out.exists()
    # info works without one and says so
    result = cli("info", cmu_checkpoint)
    assert result.exit_code == 0 and "vocabulary:  none" in result.output
    # the weights alone, when asked for
    result = cli("convert", cmu_checkpoint, "-o", out, "--no-vocab")
    assert result.exit_code == 0, result.output
    assert load_model(out).vocab is None
    with pytest.raises(CheckpointError, match="has no vocabulary"):
        load_model(out).require_vocab()
    short = tmp_path / "short.txt"
    short.write_text("a\nb\nc\n")
    assert_one_line_error(cli("info", cmu_checkpoint, "--vocab", short), "short.txt", "3 symbols", f"n_token={V}")
    # a character list
    chars = tmp_path / "chars.txt"
    chars.write_text("".join(chr(ord("!") + i) for i in range(V)) + "\n")
    result = cli("info", cmu_checkpoint, "--vocab", chars, "--vocab-kind", "char", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["vocab_kind"] == "char"


def test_convert_refuses_to_overwrite(cmu_checkpoint, tmp_path):
    write_vocab_txt(cmu_checkpoint.parent)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_one_line_error(cli("convert", cmu_checkpoint, "-o", out), "out", "--force")
    assert (out / "keep.txt").read_text() == "mine"
    result = cli("convert", cmu_checkpoint, "-o", out, "--force")
    assert result.exit_code == 0, result.output
    assert not (out / "keep.txt").exists() and load_model(out).vocab.symbols == WORDS


def test_info_reports_format_config_parameters_vocab_and_memory(cmu_checkpoint):
    write_vocab_txt(cmu_checkpoint.parent)
    result = cli("info", cmu_checkpoint, "--json")
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    loaded = load_model(cmu_checkpoint)
    assert d["format"] == "cmu" and d["vocab_size"] == V and d["config"] == loaded.config.to_dict()
    assert d["family"] == "the original CMU code's model.pt (torch.save of the whole MemTransformerLM)"
    assert d["parameters"] == sum(p.numel() for p in loaded.build().parameters())
    assert d["memory_bytes_per_stream"]["fp32"] == loaded.config.memory_bytes_per_stream()
    assert d["memory_bytes_per_stream"]["fp32"]["hidden"] == N_LAYER * MEM_LEN * D_MODEL * 4
    text = cli("info", cmu_checkpoint)
    assert text.exit_code == 0
    assert "format:      cmu (the original CMU code's model.pt" in text.output and f"{V} symbols" in text.output and "memory per stream" in text.output


def test_help_on_every_option():
    for command in ("convert", "info"):
        result = cli(command, "--help")
        assert result.exit_code == 0
        for option in ("--vocab", "--config", "--vocab-kind") + (("--force", "--no-vocab", "--output")
                                                                  if command == "convert" else ("--json",)):
            assert option in result.output
