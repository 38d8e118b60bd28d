"""Format detection: any supported checkpoint -> one `LoadedModel` (config + state_dict in our names + vocabulary).

Folders are recognised by their `config.json`, files by what they hold once read (safely: `torch_files`), and each
format's reader maps its names to ours (`txl-deploy`: identity; `huggingface`, `cmu`, `cmu-state-dict`, `nvidia`:
their `*_RULES`; `tensorflow`: `tensorflow.convert`). A bare state_dict's config comes from `config=`, else
`<name>.json` beside it, else `config.json`; every format gets its vocabulary through the one step
`vocab_files.attach_vocab`. The formats, the config's keys and where a vocabulary is looked for: docs/checkpoints.md.
"""

from __future__ import annotations

from pathlib import Path

from txl_deploy.checkpoints import cmu, huggingface, nvidia
from txl_deploy.checkpoints import native as ours
from txl_deploy.checkpoints.native import LoadedModel, read_json_object
from txl_deploy.checkpoints.tensorflow.convert import load_checkpoint as load_tf_checkpoint
from txl_deploy.checkpoints.tensorflow.discovery import is_tf_checkpoint
from txl_deploy.checkpoints.tensorflow.remi import is_remi_checkpoint, load_remi
from txl_deploy.checkpoints.torch_files import torch_load
from txl_deploy.checkpoints.unpickler import pickled_class
from txl_deploy.checkpoints.vocab_files import attach_vocab
from txl_deploy.config import TxlConfig
from txl_deploy.errors import CheckpointError
from txl_deploy.model.weights import stored_inv_freq_note

# Folder formats: (name, is_format(folder), load(folder)). Our format first: it also has a config.json.
FOLDER_FORMATS = [
    ("txl-deploy", ours.is_ours, lambda folder: ours.load_ours(folder)),
    ("huggingface", huggingface.is_hf_folder, huggingface.load_folder),
]
# What a torch.save file may hold: (name, holds_it(obj), load(obj, path, config)).
TORCH_PAYLOADS = [
    ("cmu", cmu.is_pickled_module, cmu.load_module),
    ("nvidia", nvidia.is_checkpoint, nvidia.load_checkpoint),
    ("cmu-state-dict", cmu.is_state_dict, cmu.load_state_dict),
]
# Files that, given alone, stand for the folder they are in.
FOLDER_MEMBERS = {"config.json", "model.safetensors", "pytorch_model.bin", "vocab.json"}
# What NVIDIA's train.py writes into its work directory, in the order a folder given alone is read.
NVIDIA_WORK_DIR_FILES = ("checkpoint_best.pt", "checkpoint_last.pt")


def load_any(path, config=None, vocab=None, vocab_kind: str | None = None, preset: str | None = None,
             tokenizer: str | None = None, representation: str | None = None) -> LoadedModel:
    """Load a checkpoint of any supported format. `config`: for a bare state_dict (path, dict or TxlConfig), or the
    training flags of a TensorFlow checkpoint; `vocab`: a vocabulary file overriding any other; `vocab_kind`:
    the vocabulary's kind ("word", "char", "bytes", "text8", "events") [default: the file's, the corpus's or what its
    symbols show]; `preset`: the published model a TensorFlow checkpoint is; `tokenizer`: how a word vocabulary reads
    text ("whitespace", "wikitext", "lm1b") [default: the vocabulary file's, or what its symbols show];
    `representation`: the music representation of an events vocabulary ("remi", "remi-xl") [default: the
    vocabulary's own, or what its events show]."""
    path = Path(path)
    # Before the existence check: a TensorFlow checkpoint is named by its prefix (model.ckpt-N), not a file.
    if is_remi_checkpoint(path):  # a TensorFlow checkpoint too, with its own names and settings
        loaded = load_remi(path, config=config, preset=preset)  # dictionary.pkl is beside its prefix
        return attach_vocab(loaded, vocab, kind=vocab_kind, tokenizer=tokenizer, folder=Path(loaded.path).parent,
                            representation=representation)
    if is_tf_checkpoint(path):
        # its vocabulary is its corpus cache (data/cache.pkl), or `vocab`: the corpus named there picks the preset
        loaded = load_tf_checkpoint(path, config=config, preset=preset, vocab=vocab)
        # without a corpus cache, a vocabulary beside the checkpoint's files (REMI's dictionary.pkl)
        return attach_vocab(loaded, kind=vocab_kind, tokenizer=tokenizer, folder=Path(loaded.path).parent,
                            representation=representation)
    if preset is not None:
        raise CheckpointError(path, "--preset is for TensorFlow checkpoints (model.ckpt-N or the published folder)")
    if not path.exists():
        raise CheckpointError(path, "does not exist")
    folder = path if path.is_dir() else (path.parent if path.name in FOLDER_MEMBERS else None)
    for name, is_format, load in FOLDER_FORMATS:
        if folder is not None and is_format(folder):
            if config is not None:
                raise CheckpointError(folder, f"is a {name} checkpoint, which carries its own config "
                                              "(--config is for bare state_dicts)")
            loaded = load(folder)
            vocab_dir = folder
            break
    else:
        work_dir_note = None
        if path.is_dir():
            path, work_dir_note = _work_dir_checkpoint(path)
        loaded = _load_file(path, config)
        if work_dir_note:
            loaded.notes.insert(0, work_dir_note)
        vocab_dir = path.parent
    attach_vocab(loaded, vocab, kind=vocab_kind, tokenizer=tokenizer, folder=vocab_dir, representation=representation)
    note = stored_inv_freq_note(loaded.config, loaded.state_dict)
    if note:
        loaded.notes.append(note)
    return loaded


def _work_dir_checkpoint(folder: Path) -> tuple[Path, str]:
    """The checkpoint an NVIDIA work directory (what their eval.py's --work_dir takes) stands for: the best one,
    else the last one, as their training writes them."""
    for name in NVIDIA_WORK_DIR_FILES:
        if (folder / name).is_file():
            others = [n for n in NVIDIA_WORK_DIR_FILES if n != name and (folder / n).is_file()]
            also = f" ({', '.join(others)} is also there)" if others else ""
            return folder / name, f"work directory {folder}: read {name}{also}"
    raise CheckpointError(folder, "is a folder but neither a txl-deploy checkpoint (config.json with format "
                                  "txl-deploy), a HuggingFace transfo-xl folder, nor an NVIDIA work directory "
                                  f"({' or '.join(NVIDIA_WORK_DIR_FILES)})")


def _load_file(path: Path, config) -> LoadedModel:
    if path.suffix == ".safetensors":
        return cmu.load_state_dict(huggingface.read_weights(path), path, find_config(path, config))
    obj = torch_load(path)
    for name, holds_it, load in TORCH_PAYLOADS:
        if holds_it(obj):
            if name == "cmu-state-dict":
                return load(obj, path, find_config(path, config))
            if config is not None:
                raise CheckpointError(path, f"is a {name} checkpoint, which carries its own config "
                                            "(--config is for bare state_dicts)")
            return load(obj, path)
    raise CheckpointError(path, f"is a torch.save file but not a Transformer-XL checkpoint (it holds {_describe(obj)})")


def _describe(obj) -> str:
    if pickled_class(obj):
        return f"a pickled {pickled_class(obj)}"
    if isinstance(obj, dict):
        keys = [str(k) for k in list(obj)[:6]]
        return f"a dict with keys {', '.join(keys)}{', ...' if len(obj) > 6 else ''}" if keys else "an empty dict"
    return f"a {type(obj).__name__}"


def find_config(path: Path, config):
    """The config of a bare state_dict: given, or `<stem>.json` / `config.json` beside it, or None."""
    if isinstance(config, TxlConfig):
        return config
    if isinstance(config, dict):
        return {**config, "_path": config.get("_path", "<config>")}
    if config is None:
        for candidate in (path.with_suffix(".json"), path.parent / "config.json"):
            if candidate.is_file() and candidate != path:
                config = candidate
                break
        else:
            return None
    return {**read_json_object(config), "_path": str(config)}
