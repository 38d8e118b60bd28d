"""Finding a TensorFlow checkpoint: a `model.ckpt-N` path, a `model/` folder, or the published
`pretrained_xl/tf_<name>/` layout with its `data/` folder."""

from __future__ import annotations

import re
from pathlib import Path


def _latest_prefix(model_dir: Path) -> Path | None:
    """The checkpoint a `model/` folder holds: the one its `checkpoint` file names, else the highest step."""
    state = model_dir / "checkpoint"
    if state.is_file():
        m = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', state.read_text(errors="replace"), re.M)
        if m:
            # The file often holds an absolute path of the machine (or folder) it was written in: the checkpoint
            # of that name in this folder comes first, so a moved or copied folder reads its own files.
            named = Path(m.group(1))
            for prefix in (model_dir / named.name, named if named.is_absolute() else model_dir / named):
                if Path(str(prefix) + ".index").is_file():
                    return prefix
    indexes = sorted(model_dir.glob("*.index"), key=lambda p: [int(x) if x.isdigit() else x
                                                               for x in re.split(r"(\d+)", p.name)])
    return Path(str(indexes[-1])[: -len(".index")]) if indexes else None


def find_checkpoint(path) -> tuple[Path, Path | None] | None:
    """(checkpoint prefix, data folder or None) if `path` is a TF checkpoint or the published folder layout."""
    path = Path(path)
    if path.is_dir():
        for model_dir, data_dir in ((path / "model", path / "data"), (path, path.parent / "data")):
            if model_dir.is_dir():
                prefix = _latest_prefix(model_dir)
                if prefix is not None:
                    return prefix, data_dir if data_dir.is_dir() else None
        return None
    text = str(path)
    if ".data-" in path.name:
        text = text[: text.rindex(".data-")]
    for suffix in (".index", ".meta"):
        if text.endswith(suffix):
            text = text[: -len(suffix)]
    prefix = Path(text)
    if not Path(text + ".index").is_file():
        return None
    data_dir = prefix.parent.parent / "data"
    return prefix, data_dir if (data_dir / "cache.pkl").is_file() or (data_dir / "corpus-info.json").is_file() \
        else None


def is_tf_checkpoint(path) -> bool:
    return find_checkpoint(path) is not None
