"""Shared fixtures: the tiny random Transformer-XL's checkpoint, ONNX exports and ExecuTorch program (built once per
run however many xdist workers use them, see helpers/built_once.py; read-only), runtimes on them, and HuggingFace's
TransfoXL (the checkpoint parity tests' reference).

The builders and constants behind them are in tests/helpers/ (`helpers.tiny`), which test modules import directly.
"""

from __future__ import annotations

import pytest
from helpers.built_once import built_once
from helpers.tiny import TINY_VOCAB, make_tiny_model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """A tiny word-level model in our format (adaptive softmax, div_val 2, same_length, clamp_len)."""
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    return built_once(tmp_path_factory, "ckpt", lambda d: save_checkpoint(d / "tiny", make_tiny_model(),
                                                                           Vocab(TINY_VOCAB))) / "tiny"


@pytest.fixture(scope="session")
def tiny_onnx(tiny_ckpt, tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx

    return built_once(tmp_path_factory, "onnx", lambda d: export_onnx(tiny_ckpt, d / "tiny.onnx",
                                                                       max_segment=16)) / "tiny.onnx"


@pytest.fixture(scope="session")
def tiny_onnx_full(tiny_ckpt, tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx

    return built_once(tmp_path_factory, "onnx_full", lambda d: export_onnx(tiny_ckpt, d / "tiny_full.onnx",
                                                                            state="full", max_segment=16)
                      ) / "tiny_full.onnx"


@pytest.fixture(scope="session")
def tiny_pte(tiny_ckpt, tmp_path_factory):
    """The tiny model as a verified fp32 ExecuTorch program (`tiny.pte` and its sidecar `tiny.pte.json`), mem_len 12,
    segments up to 16. Needs the executorch extra (in the test extra)."""
    from txl_deploy.exporters.executorch.export import export_executorch

    return built_once(tmp_path_factory, "pte", lambda d: export_executorch(tiny_ckpt, d / "tiny.pte",
                                                                           max_segment=16, threads=1)) / "tiny.pte"


@pytest.fixture(scope="session")
def demo_onnx(tmp_path_factory):
    """The bundled demo model exported as `txl-deploy export` exports it by default (verified; incremental state,
    segments up to 512)."""
    from txl_deploy.assets import demo_model_path
    from txl_deploy.exporters.onnx.export import export_onnx

    def build(folder):
        assert export_onnx(demo_model_path(), folder / "kjv-char.onnx").verification["passed"]

    return built_once(tmp_path_factory, "demo", build) / "kjv-char.onnx"


@pytest.fixture(scope="session")
def wikitext_onnx(tmp_path_factory):
    """The tiny WikiText-103-style word model (helpers/word_models.py) exported unverified; its checkpoint folder
    `wt` is beside it."""
    from helpers.word_models import export_wikitext_onnx

    return built_once(tmp_path_factory, "wikitext", export_wikitext_onnx) / "wt.onnx"


@pytest.fixture(scope="module")
def ort_rt(tiny_onnx):
    """A TxlRuntime on the tiny graph (ONNX Runtime), shared by a module's tests; each resets it as it needs."""
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(tiny_onnx) as rt:
        yield rt


@pytest.fixture(scope="module")
def ref_rt(tiny_ckpt):
    """A TxlRuntime on the tiny checkpoint (the eager PyTorch reference), shared by a module's tests."""
    from txl_deploy.runtimes import TxlRuntime

    return TxlRuntime.load(tiny_ckpt)


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    """A fresh in-process TxlRuntime on the tiny graph each call: what a conversation gives alone."""
    from txl_deploy.runtimes import TxlRuntime

    return lambda: TxlRuntime.load(tiny_onnx)


@pytest.fixture
def hf(monkeypatch):
    """HuggingFace's TransfoXL module (transformers' deprecated transfo_xl), made to run on current torch.
    transformers is in the test extra: where it is missing, the tests that compare with it fail."""
    import torch
    from transformers.models.deprecated import transfo_xl as transfo  # heavy: only the parity tests load it
    from transformers.utils import logging

    logging.set_verbosity_error()
    original = torch.Tensor.type_as
    # The deprecated TransfoXLModel.forward calls `torch.arange(...).type_as(dtype=word_emb.dtype)`; current torch
    # only has `type_as(other)` and raises TypeError. Let the `dtype=` keyword mean `.to(dtype)`.
    monkeypatch.setattr(torch.Tensor, "type_as",
                        lambda self, other=None, dtype=None: self.to(dtype) if other is None else original(self, other))
    return transfo


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
    from helpers import character_corpora as cc  # writes with TensorFlow (the test extra), which it imports

    symbols, _, weights, hp = enwik8_cycle
    return built_once(tmp_path_factory, "tf_enwik8", lambda d: cc.write_tf_published(
        d / "pretrained_xl" / "tf_enwik8", weights, hp, symbols, "enwik8")) / "pretrained_xl" / "tf_enwik8"


@pytest.fixture(scope="session")
def tf_enwik8_onnx(tf_enwik8, tmp_path_factory):
    """The TensorFlow enwik8 checkpoint exported (verified) with no vocabulary flags: its kind comes from the corpus."""
    from txl_deploy.exporters.export import export_checkpoint

    return built_once(tmp_path_factory, "tf_enwik8_onnx", lambda d: export_checkpoint(
        tf_enwik8, d / "enwik8.onnx", config=tf_enwik8 / "flags.json", max_segment=16, threads=1)) / "enwik8.onnx"


@pytest.fixture(scope="session")
def tritonserver():
    """The tritonserver the serving tests run (found as `TritonServer` finds it: $TXL_TRITONSERVER, nvidia-pytriton's
    under .venv/triton or in site-packages, or PATH). A test that needs a real server takes this fixture, and skips
    with the command that installs one where there is none."""
    from txl_deploy.serving.triton.local_server import TritonLaunchError, find_tritonserver

    try:
        return find_tritonserver()
    except TritonLaunchError as e:
        pytest.skip(str(e))
