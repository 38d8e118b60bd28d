"""Random-weight stand-ins of the published shapes, timed like the real model (speed depends on the shapes, not
the values): weights drawn like a fresh model's, built and exported once per cache folder, shape, mem_len, layout
and seed."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from txl_deploy.checkpoints import save_checkpoint
from txl_deploy.config import PUBLISHED_SHAPES, TxlConfig, published_config
from txl_deploy.errors import InputError
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.vocab import Vocab

logger = logging.getLogger(__name__)

SEED = 0
INIT = "nonzero-biases"  # how `random_model` draws the weights: part of a cached stand-in's key

# The paper's other published models, as stand-in shapes only: text8 is enwik8 large over 27 symbols; One Billion
# Word's 0.8B model takes the original code's lm1b cutoffs, no projection tied, evaluated with 32 / 128 / no clamp.
STANDIN_SHAPES: dict[str, dict] = {
    "text8": {**PUBLISHED_SHAPES["enwik8-large"], "n_token": 27},
    "lm1b-large": dict(
        n_token=793470, n_layer=24, n_head=16, d_model=1280, d_head=80, d_inner=8192,
        cutoffs=[60000, 100000, 640000], div_val=4, tie_weight=True, tie_projs=[False] * 4, untie_r=True,
        mem_len=128, tgt_len=32, clamp_len=0, same_length=True,
    ),
}


def is_shape_name(name: str) -> bool:
    return str(name) in PUBLISHED_SHAPES or str(name) in STANDIN_SHAPES


def shape_config(name: str, **overrides) -> TxlConfig:
    """The config of a published shape or of a stand-in-only shape (`STANDIN_SHAPES`)."""
    if str(name) in STANDIN_SHAPES:
        return TxlConfig(**{**STANDIN_SHAPES[name], **overrides})
    return published_config(name, **overrides)


def random_model(config, seed: int = SEED):
    """A MemTransformerLM of `config` with reproducible random weights; biases small and nonzero, as a trained
    model's (an exporter drops a zero bias, and with it work a real model's graph does)."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.mem_transformer import MemTransformerLM  # imports torch

    gen = torch.Generator().manual_seed(seed)
    model = MemTransformerLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm.weight" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def char_vocab(n: int):
    return Vocab([f"<{i}>" for i in range(n)], kind="word")


def standin_checkpoint(name: str, cache_dir, mem_len: int | None = None, seed: int = SEED) -> Path:
    """Our checkpoint folder for the published shape `name` (random weights), built once per cache_dir."""
    if not is_shape_name(name):
        raise InputError(f"unknown shape {name!r}; known: {', '.join([*PUBLISHED_SHAPES, *STANDIN_SHAPES])}")
    overrides = {} if mem_len is None else {"mem_len": int(mem_len)}
    config = shape_config(name, **overrides)
    key = hashlib.sha256(json.dumps([config.to_dict(), seed, INIT], sort_keys=True).encode()).hexdigest()[:10]
    path = Path(cache_dir) / f"{name}-{key}"
    if not path.exists():
        logger.info(f"building a random-weight stand-in of {name} (mem_len {config.mem_len})")
        save_checkpoint(path, random_model(config, seed), char_vocab(config.n_token))
    return path


def standin_onnx(checkpoint, cache_dir, mem_len: int, state: str = "incremental", max_segment: int = 512) -> Path:
    """The ONNX export of `checkpoint` with the given memory length and layout, cached beside it."""
    checkpoint = Path(checkpoint)
    path = Path(cache_dir) / f"{checkpoint.name}-{_content_key(checkpoint)}-m{mem_len}-s{max_segment}-{state}.onnx"
    if not path.exists():
        export_onnx(checkpoint, path, mem_len=mem_len, state=state, max_segment=max_segment, verify=False)
    return path


def _content_key(checkpoint: Path) -> str:
    """Changes with the checkpoint's files (names, sizes, times) and the code that writes the graph, so that a
    stale cached export is never benchmarked."""
    import txl_deploy.model.cached_step  # imports torch
    import txl_deploy.model.output_layer  # imports torch

    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    stats = [(str(p.relative_to(checkpoint) if checkpoint.is_dir() else p.name), p.stat().st_size,
              p.stat().st_mtime_ns) for p in files]
    code = [Path(m.__file__).read_bytes().hex() for m in (txl_deploy.model.cached_step, txl_deploy.model.output_layer,
                                                        txl_deploy.exporters.onnx.export)]
    return hashlib.sha256(json.dumps([stats, code]).encode()).hexdigest()[:10]
