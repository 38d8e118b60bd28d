"""What a checkpoint reader is: a family's test "is this mine" and its read, over one `Source`.

`detect.READERS` lists the readers in the order they are asked; the first that claims a path reads it. A claim is
cheap: it looks at the path, at the folder's `config.json`, or at the object the file unpickles to (safely, through
`torch_files`). `Source` reads each of those at most once, whichever readers look, and hands the same object on
to the read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable

from txl_deploy.checkpoints.torch_files import torch_load
from txl_deploy.errors import CheckpointError

# Files that, given alone, stand for the folder they are in.
FOLDER_MEMBERS = {"config.json", "model.safetensors", "pytorch_model.bin", "vocab.json"}
# What NVIDIA's train.py writes into its work directory, in the order a folder given alone is read.
NVIDIA_WORK_DIR_FILES = ("checkpoint_best.pt", "checkpoint_last.pt")


@dataclass
class Source:
    """A checkpoint path and what the caller said about it (`config`, `preset`, `vocab`), with what readers look
    at read once: the folder's `config.json`, the file a path stands for and the object that file holds."""

    path: Path
    config: object = None  # a config file, dict or TxlConfig: for a reader that takes one
    preset: str | None = None
    vocab: object = None  # a vocabulary file the user names
    notes: list = field(default_factory=list)  # what a user should know about how the path was read
    _found: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.path = Path(self.path)

    def once(self, key: str, look: Callable[[], object]):
        """`look()` the first time a reader asks for `key`, the same answer after: a claim's finding for its read."""
        if key not in self._found:
            self._found[key] = look()
        return self._found[key]

    @cached_property
    def folder(self) -> Path | None:
        """The folder a folder format would be read from: the path, or the folder of a member file given alone."""
        if not self.path.exists():
            raise CheckpointError(self.path, "does not exist")
        if self.path.is_dir():
            return self.path
        return self.path.parent if self.path.name in FOLDER_MEMBERS else None

    @cached_property
    def folder_config(self) -> dict | None:
        """The folder's `config.json` as an object, or None (no folder, no file, not JSON, not an object)."""
        if self.folder is None:
            return None
        try:
            data = json.loads((self.folder / "config.json").read_text())
        except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python recurses
            return None
        return data if isinstance(data, dict) else None

    @cached_property
    def file(self) -> Path:
        """The file a file format reads: the path, or the checkpoint an NVIDIA work directory (what their eval.py's
        --work_dir takes) stands for, the best one, else the last one, as their training writes them."""
        if self.folder is None or not self.path.is_dir():
            return self.path
        for name in NVIDIA_WORK_DIR_FILES:
            if (self.path / name).is_file():
                others = [n for n in NVIDIA_WORK_DIR_FILES if n != name and (self.path / n).is_file()]
                also = f" ({', '.join(others)} is also there)" if others else ""
                self.notes.append(f"work directory {self.path}: read {name}{also}")
                return self.path / name
        raise CheckpointError(self.path, "is a folder but neither a txl-deploy checkpoint (config.json with format "
                                         "txl-deploy), a HuggingFace transfo-xl folder, nor an NVIDIA work "
                                         f"directory ({' or '.join(NVIDIA_WORK_DIR_FILES)})")

    @cached_property
    def payload(self):
        """What the file holds: a .safetensors file's tensors, else what it unpickles to (restricted unpickler)."""
        return read_safetensors(self.file) if self.file.suffix == ".safetensors" else torch_load(self.file)


@dataclass(frozen=True)
class Reader:
    """One checkpoint family. `name`: what `LoadedModel.source_format` and `info` call it; `family`: the project and
    file it comes from, for people; `claims(source)`: whether the source is this family's; `read(source)`: the
    `LoadedModel` (vocabulary still to attach); `location(source)`: what it reads (errors name it);
    `vocab_folder(source)`: where a vocabulary file beside it is looked for (None: nowhere); `takes`: the caller's options the read uses ("config", "preset": refused by a reader without them;
    "vocab": the read opens the user's vocabulary file itself, else the registry attaches it)."""

    name: str
    family: str
    claims: Callable[[Source], bool]
    read: Callable[[Source], object]
    location: Callable[[Source], Path] = lambda source: source.file
    vocab_folder: Callable[[Source], Path | None] = lambda source: source.file.parent
    takes: frozenset = frozenset()

    @staticmethod
    def of_folder(name: str, family: str, claims, read) -> "Reader":
        """A reader of a folder format: it reads the folder, and a vocabulary is looked for in it."""
        return Reader(name, family, claims, read, location=lambda s: s.folder, vocab_folder=lambda s: s.folder)


def read_safetensors(file: Path) -> dict:
    """A .safetensors file's tensors; a one-line error naming the file otherwise."""
    from safetensors import SafetensorError  # optional (the torch extra)
    from safetensors.torch import load_file  # optional (the torch extra)

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(file, f"not a readable safetensors file ({e})") from None


def carries_own_config(path, name: str) -> CheckpointError:
    """The one error for --config given with a checkpoint that holds its config."""
    return CheckpointError(path, f"is a {name} checkpoint, which carries its own config (--config is for bare "
                                 "state_dicts)")
