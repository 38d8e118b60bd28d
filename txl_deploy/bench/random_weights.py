"""Random-weight stand-ins of the published shapes: what `bench enwik8-base` measures when no trained model is
at hand. Speed depends on the shapes, not on the values, so a stand-in is timed exactly like the real model.

The weights are drawn like a freshly initialised model (normal(0, 0.02), layer norms at identity), which keeps
log-probabilities finite and comparable between backends. Built models and their ONNX exports are cached in a
directory keyed by shape name, mem_len, layout and seed, so repeated benchmark runs do not re-export.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from txl_deploy.checkpoints import save_checkpoint
from txl_deploy.config import PUBLISHED_SHAPES, published_config
from txl_deploy.errors import InputError
from txl_deploy.exporters.onnx.export import export_onnx
from txl_deploy.vocab import Vocab

logger = logging.getLogger(__name__)

SEED = 0


def is_shape_name(name: str) -> bool:
    return str(name) in PUBLISHED_SHAPES


def random_model(config, seed: int = SEED):
    """A MemTransformerLM of `config` with reproducible random weights."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.mem_transformer import MemTransformerLM  # imports torch

    gen = torch.Generator().manual_seed(seed)
    model = MemTransformerLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm.weight" in name:
                p.fill_(1.0)
            elif "layer_norm.bias" in name or name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def char_vocab(n: int):
    return Vocab([f"<{i}>" for i in range(n)], kind="word")


def standin_checkpoint(name: str, cache_dir, mem_len: int | None = None, seed: int = SEED) -> Path:
    """Our checkpoint folder for the published shape `name` (random weights), built once per cache_dir."""
    if not is_shape_name(name):
        raise InputError(f"unknown shape {name!r}; known: {', '.join(PUBLISHED_SHAPES)}")
    overrides = {} if mem_len is None else {"mem_len": int(mem_len)}
    config = published_config(name, **overrides)
    key = hashlib.sha256(json.dumps([config.to_dict(), seed], sort_keys=True).encode()).hexdigest()[:10]
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
    """Changes whenever the checkpoint's files do (names, sizes, modification times) or the code that writes the
    graph does: a model retrained in place, or a new exporter, is exported again instead of being benchmarked
    through a stale cached export."""
    import txl_deploy.model.cached_step  # imports torch

    files = sorted(p for p in checkpoint.rglob("*") if p.is_file()) if checkpoint.is_dir() else [checkpoint]
    stats = [(str(p.relative_to(checkpoint) if checkpoint.is_dir() else p.name), p.stat().st_size,
              p.stat().st_mtime_ns) for p in files]
    code = [Path(m.__file__).read_bytes().hex() for m in (txl_deploy.model.cached_step, txl_deploy.exporters.onnx.export)]
    return hashlib.sha256(json.dumps([stats, code]).encode()).hexdigest()[:10]
