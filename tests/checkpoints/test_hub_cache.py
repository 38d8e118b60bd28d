"""hf:// references read from a HuggingFace hub cache laid out as huggingface_hub lays it out, offline: blobs named
by their hashes, a snapshot folder of relative links into them, refs/main naming the snapshot's commit. The cache
holds a tiny transfo-xl folder as transformers' save_pretrained writes it, with the old (plain dict) vocab.pkl
layout; `txl-deploy export hf://OWNER/NAME` reads it through the links, a link leaving the repository's cache folder
is refused, and missing repositories and bad references get one-line errors."""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys

import pytest
from helpers.cli import assert_one_line_error, cli
from helpers.reference_models import build_hf_from, original_kwargs
from helpers.word_models import WIKITEXT_SYMBOLS

from txl_deploy.checkpoints.hub import fetch_snapshot
from txl_deploy.errors import CheckpointError, install_hint

OWNER, NAME = "someone", "tiny-transfo-xl"
REPO = f"hf://{OWNER}/{NAME}"
COMMIT = hashlib.sha1(b"the tiny model's first commit").hexdigest()
LFS_SUFFIXES = (".safetensors", ".bin", ".pkl")  # what the hub stores in LFS (blob named by its sha256)


def git_blob_sha(data: bytes) -> str:
    """The name git (and so the hub cache) gives a small file's blob: sha1 of 'blob LEN\\0' + the data."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lay_out_as_hub_cache(folder, cache, owner=OWNER, name=NAME, commit=COMMIT):
    """The files of `folder` as huggingface_hub caches repository owner/name at `commit` (the main branch);
    returns the snapshot folder."""
    storage = cache / f"models--{owner}--{name}"
    (storage / "blobs").mkdir(parents=True)
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest() if file.suffix in LFS_SUFFIXES else git_blob_sha(data)
        (storage / "blobs" / blob).write_bytes(data)
        os.symlink(f"../../blobs/{blob}", snapshot / file.name)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)  # no newline, as the hub writes it
    return snapshot


def old_layout_vocab_pkl(symbols) -> bytes:
    """A vocab.pkl in pytorch-pretrained-bert's layout: the tokenizer's settings and symbols as a plain dict."""
    return pickle.dumps({"idx2sym": list(symbols), "sym2idx": {s: i for i, s in enumerate(symbols)},
                         "special": ["<eos>"], "min_freq": 0, "max_size": None, "lower_case": False,
                         "delimiter": None, "vocab_file": None, "never_split": ["<unk>", "<eos>", "<formula>"]},
                        protocol=2)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A tiny HuggingFace transfo-xl folder (config.json, model.safetensors) with a vocab.pkl of WikiText-103's
    kind of symbols."""
    import torch
    from transformers.models.deprecated import transfo_xl as transfo  # builds the folder HuggingFace writes
    from transformers.utils import logging

    logging.set_verbosity_error()
    hp = original_kwargs(n_token=len(WIKITEXT_SYMBOLS), cutoffs=[10, 30], div_val=2, d_embed=16,
                         tie_projs=[False, True, True], same_length=True)
    model = build_hf_from(transfo, hp, untie_r=True)
    folder = tmp_path_factory.mktemp("hf") / NAME
    with torch.no_grad():
        model.save_pretrained(folder)
    (folder / "vocab.pkl").write_bytes(old_layout_vocab_pkl(WIKITEXT_SYMBOLS))
    return folder


@pytest.fixture
def offline_cache(hf_folder, tmp_path, monkeypatch):
    """The hub cache under tmp_path holding hf_folder as someone/tiny-transfo-xl, with HF_HUB_OFFLINE=1;
    returns the snapshot folder."""
    cache = tmp_path / "hub"
    snapshot = lay_out_as_hub_cache(hf_folder, cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    return snapshot


def test_export_of_a_hub_reference_reads_the_offline_cache_through_its_links(offline_cache, tmp_path):
    from txl_deploy.runtimes import TxlRuntime

    assert all((offline_cache / f).is_symlink() for f in ("config.json", "model.safetensors", "vocab.pkl"))
    result = cli("export", REPO, "--max-segment", "8")
    assert result.exit_code == 0, result.output
    out = tmp_path / f"{NAME}.onnx"  # named after the repository, not the snapshot's commit
    assert out.is_file()
    with TxlRuntime.load(out) as rt:
        assert rt.vocab is not None and rt.vocab.symbols == WIKITEXT_SYMBOLS  # the vocabulary came from vocab.pkl
        assert rt.config.n_token == len(WIKITEXT_SYMBOLS)
        assert rt.vocab.tokenizer == "wikitext"  # HuggingFace's tokenizer read it with the Moses pipeline
        prompt = [int(i) for i in rt.encode("the game was released in 2004")]
        tokens = list(rt.generate(prompt, 30, seed=3))
        expected = rt.vocab.decode(prompt + tokens) + "\n"
        as_tokens = rt.vocab.with_tokenizer("whitespace").decode(prompt + tokens) + "\n"
    # generate from the export prints natural text: the split markers joined again
    printed = cli("generate", out, "--prompt", "the game was released in 2004", "--max-new-tokens", 30, "--seed", 3)
    assert printed.exit_code == 0, printed.output
    assert printed.stdout == expected
    assert any(WIKITEXT_SYMBOLS[t] in ("@-@", "@,@", "@.@", ",", ".") for t in tokens)
    assert printed.stdout != as_tokens  # detokenized, not the tokens with spaces between


def test_info_and_load_model_take_a_hub_reference(offline_cache):
    from txl_deploy.checkpoints import load_model

    loaded = load_model(REPO)  # the Python API reads the same snapshot as the command line
    assert loaded.vocab.symbols == WIKITEXT_SYMBOLS and loaded.vocab.tokenizer == "wikitext"
    assert loaded.vocab_source.endswith("vocab.pkl")
    result = cli("info", REPO)
    assert result.exit_code == 0, result.output
    assert "tokenizer: wikitext" in result.stdout and "vocab.pkl" in result.stdout


@pytest.mark.parametrize("revision", ["", "@main", f"@{COMMIT}"], ids=["main", "branch", "commit"])
def test_a_revision_names_the_snapshot_read(offline_cache, tmp_path, revision):
    result = cli("convert", REPO + revision, "-o", tmp_path / "converted")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "converted" / "model.safetensors").is_file()
    assert f"{len(WIKITEXT_SYMBOLS)} symbols" in result.stdout


def test_an_unknown_revision_offline_is_one_line(offline_cache):
    assert_one_line_error(cli("convert", REPO + "@v2", "-o", "out"), REPO + "@v2", "not in the hub cache",
                          "HF_HUB_OFFLINE")


@pytest.mark.parametrize("where", ["outside the cache", "another repository's blobs"])
def test_a_link_leaving_the_repositorys_cache_folder_is_refused(offline_cache, tmp_path, where):
    if where == "outside the cache":
        target = tmp_path / "elsewhere" / "model.safetensors"
    else:
        target = tmp_path / "hub" / "models--other--model" / "blobs" / "0123abcd"
    target.parent.mkdir(parents=True)
    shutil.copyfile(offline_cache / "model.safetensors", target)
    (offline_cache / "model.safetensors").unlink()
    os.symlink(os.path.relpath(target, offline_cache), offline_cache / "model.safetensors")
    result = cli("export", REPO, "-o", tmp_path / "out.onnx")
    assert_one_line_error(result, "model.safetensors", str(target), "outside the repository's cache folder")
    assert not (tmp_path / "out.onnx").exists()


def test_a_linked_snapshot_folder_outside_the_cache_is_refused(offline_cache, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(offline_cache, moved, symlinks=False)  # the files themselves, outside the cache
    shutil.rmtree(offline_cache)
    os.symlink(moved, offline_cache)
    assert_one_line_error(cli("convert", REPO, "-o", tmp_path / "out"), "outside the repository's cache folder")


def test_a_dangling_link_says_the_download_is_incomplete(offline_cache, tmp_path):
    blob = (offline_cache / "model.safetensors").resolve()
    blob.unlink()
    assert_one_line_error(cli("convert", REPO, "-o", tmp_path / "out"), "model.safetensors", "fetch it again")


def test_a_repository_missing_from_the_offline_cache_is_one_line(offline_cache, tmp_path):
    result = cli("export", "hf://someone/not-fetched", "-o", tmp_path / "out.onnx")
    assert_one_line_error(result, "hf://someone/not-fetched", "not in the hub cache", "HF_HUB_OFFLINE")


@pytest.mark.parametrize("reference", ["hf://", "hf://a/b/c/d", "hf://a b/c", "hf://a/b@../../etc", "hf://a/b@",
                                       "hf://-a/b", "hf://a--b/c", "hf://a/b\n"])
@pytest.mark.parametrize("command", ["export", "convert", "generate", "serve", "eval"])
def test_a_bad_reference_is_one_line(reference, command):
    extra = {"convert": ["-o", "out"], "generate": ["--prompt", "x"], "eval": ["--text", __file__]}.get(command, [])
    assert_one_line_error(cli(command, reference, *extra), "hf://")


def test_without_huggingface_hub_the_error_names_the_extra(offline_cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import huggingface_hub raises ImportError
    assert_one_line_error(cli("convert", REPO, "-o", "out"), install_hint("hub"))


def test_when_the_hub_cannot_be_reached_the_cache_is_read_with_a_warning(offline_cache, monkeypatch, caplog):
    import huggingface_hub
    import requests

    def unreachable(*args, **kwargs):
        raise requests.exceptions.ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", unreachable)
    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", unreachable)  # what snapshot_download asks
    with caplog.at_level("WARNING", logger="txl_deploy"):
        assert fetch_snapshot(REPO) == offline_cache
    assert any("could not be reached" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_online_only_the_files_a_transfo_xl_folder_needs_are_fetched(offline_cache, monkeypatch):
    """transfo-xl-wt103's repository also holds TensorFlow weights and both vocabulary pickles: one set of
    PyTorch weights (safetensors first, else pytorch_model.bin, or an index and its shards) and one vocabulary."""
    import huggingface_hub
    from huggingface_hub.hf_api import ModelInfo

    listings = {
        "single": (["config.json", "pytorch_model.bin", "model.safetensors", "tf_model.h5", "vocab.pkl", "vocab.bin",
                    "README.md", ".gitattributes"], ["config.json", "model.safetensors", "vocab.pkl"]),
        "bin": (["config.json", "pytorch_model.bin", "tf_model.h5", "vocab.bin"],
                ["config.json", "pytorch_model.bin", "vocab.bin"]),
        "shards": (["config.json", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
                    "pytorch_model-00002-of-00002.bin", "tf_model.h5", "vocab.txt", "vocab.pkl"],
                   ["config.json", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin",
                    "pytorch_model-00002-of-00002.bin", "vocab.txt"]),
    }
    asked = {}
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    for case, (files, expected) in listings.items():
        def model_info(self, repo_id, revision=None, files=files, **kwargs):
            return ModelInfo(id=repo_id, sha=COMMIT, siblings=[{"rfilename": f} for f in files])

        def snapshot_download(repo_id, allow_patterns=None, local_files_only=False, case=case, **kwargs):
            asked[case] = (allow_patterns, local_files_only)
            return str(offline_cache)  # what the download returns: the snapshot folder

        monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        assert fetch_snapshot(REPO) == offline_cache
        assert asked[case] == (expected, False), case


def test_a_repository_without_weights_is_refused_before_anything_is_fetched(offline_cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub.hf_api import ModelInfo

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo_id, **kw: ModelInfo(
        id=repo_id, sha=COMMIT, siblings=[{"rfilename": f} for f in ("config.json", "tf_model.h5", "vocab.pkl")]))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: pytest.fail("fetched"))
    with pytest.raises(CheckpointError, match="has no PyTorch weights"):
        fetch_snapshot(REPO)


def test_every_file_is_fetched_at_the_commit_the_listing_was_read_at(offline_cache, monkeypatch):
    """The branch moves on the hub between the listing and the download: the files come from the commit listed,
    and the cache's ref records that commit, so the same reference reads the same snapshot offline afterwards."""
    import huggingface_hub
    from huggingface_hub.hf_api import ModelInfo

    storage = offline_cache.parent.parent
    moved = hashlib.sha1(b"a later commit, pushed while fetching").hexdigest()
    asked = []
    real_download = huggingface_hub.snapshot_download

    def model_info(self, repo_id, revision=None, **kwargs):
        (storage / "refs" / "main").write_text(moved)  # the branch moves right after it was listed
        return ModelInfo(id=repo_id, sha=COMMIT, siblings=[{"rfilename": f} for f in
                                                           ("config.json", "model.safetensors", "vocab.pkl")])

    def snapshot_download(repo_id, revision=None, local_files_only=False, **kwargs):
        asked.append(revision)  # what is downloaded: the cache's snapshot of that revision (no network here)
        return real_download(repo_id, revision=revision, local_files_only=True, **kwargs)

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert fetch_snapshot(REPO) == offline_cache
    assert fetch_snapshot(REPO + "@main") == offline_cache
    assert asked == [COMMIT, COMMIT]
    assert (storage / "refs" / "main").read_text() == COMMIT
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert fetch_snapshot(REPO) == offline_cache
