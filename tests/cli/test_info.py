"""`txl-deploy info` tells one story about a model whatever file it reads: the same parameter count for a
checkpoint and every graph exported from it, an int4 graph's stored check against fp32, and the vocabulary itself
(`--list-vocab`), which an error about a symbol the vocabulary lacks points to."""

from __future__ import annotations

import json

import pytest
from helpers.cli import assert_one_line_error, cli

from txl_deploy.assets import demo_model_path
from txl_deploy.errors import InputError
from txl_deploy.vocab import Vocab


def _info(path, *options) -> dict:
    r = cli("info", path, "--json", *options)
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def int4_export(tiny_ckpt, tmp_path_factory):
    """The tiny model exported by `export --precision int4`: (the file, what the command printed)."""
    out = tmp_path_factory.mktemp("int4") / "tiny-int4.onnx"
    r = cli("export", tiny_ckpt, "--precision", "int4", "--block-size", "16", "--max-segment", "16", "-o", out)
    assert r.exit_code == 0, r.output
    return out, r.output


def test_export_int4_names_only_the_files_it_leaves(int4_export):
    out, printed = int4_export
    assert "txl-export-" not in printed and "fp32.onnx" not in printed, printed
    assert f"wrote {out}" in printed


def test_a_checkpoint_and_its_graphs_have_the_same_parameter_count(tiny_ckpt, tiny_onnx, int4_export):
    counts = {name: _info(path)["parameters"] for name, path in
              (("checkpoint", tiny_ckpt), ("fp32", tiny_onnx), ("int4", int4_export[0]))}
    assert counts["checkpoint"] > 0 and set(counts.values()) == {counts["checkpoint"]}, counts


def test_info_on_an_int4_graph_shows_its_check_against_fp32(int4_export):
    r = cli("info", int4_export[0])
    assert r.exit_code == 0, r.output
    assert "not known" not in r.output and "not recorded" not in r.output
    assert "precision:   int4 (MatMulNBits (com.microsoft), 4-bit blocks of 16)" in r.output, r.output
    assert "against fp32: KL divergence" in r.output and "top-1 agreement" in r.output, r.output


def test_list_vocab_prints_each_symbol_with_its_id(tiny_ckpt, tiny_onnx):
    symbols = _info(tiny_onnx, "--list-vocab")
    assert symbols == _info(tiny_ckpt, "--list-vocab") and len(symbols) > 2
    r = cli("info", tiny_onnx, "--list-vocab")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [f"{i}\t{s!r}" for i, s in enumerate(symbols)]


def test_a_symbol_the_vocabulary_lacks_says_how_to_see_it():
    vocab = Vocab(["a", "b", " ", "\n"], kind="char", unk=None, eos=None)
    with pytest.raises(InputError) as e:
        vocab.encode("ab€")
    assert "'€'" in str(e.value) and "'a', 'b', ' ', '\\n'" in str(e.value)
    assert "txl-deploy info MODEL --list-vocab" in str(e.value)


def test_the_command_line_points_to_the_vocabulary_listing():
    r = cli("generate", demo_model_path(), "--prompt", "And God said \u20ac", "--max-new-tokens", "1")
    assert_one_line_error(r, "'\u20ac'", "--list-vocab")
