"""Shared fixtures: tiny random Transformer-XL checkpoints and their ONNX exports (built once per session)."""

from __future__ import annotations

import pytest

TINY = dict(n_token=60, n_layer=2, n_head=2, d_model=32, d_head=8, d_inner=64, mem_len=12, tgt_len=8,
            cutoffs=[10, 30], div_val=2, tie_projs=[False, True, True], same_length=True, clamp_len=9)
TINY_VOCAB = [f"w{i}" for i in range(58)] + ["<eos>", "<unk>"]


def make_tiny_model(seed=0, **overrides):
    import torch

    from txl_deploy.config import TxlConfig
    from txl_deploy.model.mem_transformer import MemTransformerLM

    torch.manual_seed(seed)
    model = MemTransformerLM(TxlConfig(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny word-level model in our format (adaptive softmax, div_val 2, same_length, clamp_len)."""
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    path = tmp_path_factory.mktemp("ckpt") / "tiny"
    save_checkpoint(path, make_tiny_model(), Vocab(TINY_VOCAB))
    return path


@pytest.fixture(scope="session")
def tiny_onnx(tiny_ckpt, tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_onnx(tiny_ckpt, out, max_segment=16)
    return out


@pytest.fixture(scope="session")
def tiny_onnx_full(tiny_ckpt, tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "tiny_full.onnx"
    export_onnx(tiny_ckpt, out, state="full", max_segment=16)
    return out


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    """A fresh in-process TxlRuntime on the tiny graph each call: what a conversation gives alone."""
    from txl_deploy.runtimes import TxlRuntime

    return lambda: TxlRuntime.load(tiny_onnx)


# -- the paper's character corpora (helpers/character_corpora.py) ----------------------------------------------------
@pytest.fixture(scope="session")
def enwik8_cycle():
    """A byte-level model over a stand-in for enwik8 whose greedy generation is known in advance:
    (idx2sym, successor of each symbol, weights in the original names, the original constructor's kwargs)."""
    from helpers import character_corpora as cc

    return cc.enwik8_model()


@pytest.fixture(scope="session")
def tf_enwik8(enwik8_cycle, tmp_path_factory):
    """That model as the paper's TensorFlow checkpoint folder (pretrained_xl/tf_enwik8/: model/ written by
    TensorFlow's Saver, data/cache.pkl, data/corpus-info.json; flags.json with its training flags)."""
    pytest.importorskip("tensorflow")
    from helpers import character_corpora as cc

    symbols, _, weights, hp = enwik8_cycle
    return cc.write_tf_published(tmp_path_factory.mktemp("pretrained_xl") / "tf_enwik8", weights, hp, symbols,
                                 "enwik8")


@pytest.fixture(scope="session")
def tf_enwik8_onnx(tf_enwik8, tmp_path_factory):
    """The TensorFlow enwik8 checkpoint exported (verified) with no vocabulary flags: its kind comes from the corpus."""
    from txl_deploy.exporters.export import export_checkpoint

    out = tmp_path_factory.mktemp("onnx") / "enwik8.onnx"
    export_checkpoint(tf_enwik8, out, config=tf_enwik8 / "flags.json", max_segment=16, threads=1)
    return out
