"""Our own checkpoint format: a folder with config.json, model.safetensors and vocab.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from txl_deploy.checkpoints.reader import Reader
from txl_deploy.checkpoints.vocab_files import open_vocab_file
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError, TxlError
from txl_deploy.files import atomic_path
from txl_deploy.vocab import Vocab

FORMAT = "txl-deploy"
FORMAT_VERSION = 1
CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE = "config.json", "model.safetensors", "vocab.json"


def read_json_object(path, what: str = "a JSON object"):
    """A JSON config file's top-level object; a one-line CheckpointError naming the file otherwise."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, "config file not found") from None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than Python recurses
        raise CheckpointError(path, f"not a readable JSON config ({str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise CheckpointError(path, f"config must be {what}")
    return data


@dataclass
class LoadedModel:
    config: TxlConfig
    state_dict: dict  # our parameter names -> torch tensors (tied parameters may be absent)
    vocab: Vocab | None
    source_format: str  # "txl-deploy", "cmu", "cmu-state-dict", "huggingface", "nvidia"
    path: str
    notes: list = field(default_factory=list)  # what a user should know about the source (semantics, guesses)
    vocab_source: str | None = None  # where the vocabulary came from (a file, or the checkpoint)
    vocab_format: str | None = None  # what that file is, for people ("vocab.pkl (transformers ...)")
    dataset: str | None = None  # the corpus the checkpoint names (enwik8 and text8 fix the vocabulary's kind)

    def require_vocab(self) -> Vocab:
        """The vocabulary, or a CheckpointError saying it is missing (for commands that read or write text)."""
        if self.vocab is None:
            raise CheckpointError(self.path, "has no vocabulary (none inside it and no vocab.json / vocab.txt / "
                                             "vocab.pkl / vocab.bin / cache.pt / dictionary.pkl beside it); pass "
                                             "--vocab FILE")
        return self.vocab

    def build(self):
        """The reference `MemTransformerLM` (eval mode) with these weights; shapes are checked against the config."""
        from txl_deploy.model.weights import build_model  # imports torch

        return build_model(self.config, self.state_dict, self.path)


def save_checkpoint(directory, model, vocab: Vocab | None, force: bool = False, extra: dict | None = None):
    """Write `model` (a MemTransformerLM) and its vocabulary in our format, atomically."""
    from safetensors.torch import save_file  # optional (the torch extra)

    tied = model.tied_keys()
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in tied}
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "config": model.cfg.to_dict()}
    if extra:
        meta.update(extra)
    with atomic_path(directory, force=force) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": FORMAT})
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if vocab is not None:
            vocab.save(tmp / VOCAB_FILE)
    return Path(directory)


def load_ours(path, meta: dict | None = None) -> LoadedModel:
    """`meta`: the folder's config.json, when the caller has read it already."""
    from safetensors import SafetensorError  # optional (the torch extra)
    from safetensors.torch import load_file  # optional (the torch extra)

    path = Path(path)
    if meta is None:
        try:
            meta = json.loads((path / CONFIG_FILE).read_text())
        except (OSError, ValueError, RecursionError) as e:
            raise CheckpointError(path / CONFIG_FILE, f"unreadable config ({str(e)[:200]})") from None
    version = meta.get("format_version", 0) if isinstance(meta, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(path / CONFIG_FILE, "not a txl-deploy config (no format_version number)")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(path, f"written by a newer txl-deploy (format_version {meta['format_version']})")
    try:
        config = TxlConfig.from_dict(meta["config"])
    except (KeyError, TxlError) as e:
        raise CheckpointError(path / CONFIG_FILE, f"bad config: {e}") from None
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(weights, "weights file missing")
    try:
        state_dict = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(weights, f"not a readable safetensors file ({e})") from None
    if not (path / VOCAB_FILE).is_file():
        return LoadedModel(config, state_dict, None, FORMAT, str(path))
    found = open_vocab_file(path / VOCAB_FILE)
    return LoadedModel(config, state_dict, found.vocab, FORMAT, str(path), vocab_source=str(path / VOCAB_FILE),
                       vocab_format=found.format)


READER = Reader.of_folder(FORMAT, "txl-deploy's own folder (config.json, model.safetensors, vocab.json)",
                          lambda s: (s.folder_config or {}).get("format") == FORMAT,
                          lambda s: load_ours(s.folder, s.folder_config))
