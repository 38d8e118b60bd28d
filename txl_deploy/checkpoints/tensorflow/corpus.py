"""`data/corpus-info.json` of a TensorFlow checkpoint's folder (vocabulary size, cutoffs, dataset name), cross-checked
against the weights. Its vocabulary, `data/cache.pkl`, is read by `checkpoints.vocab_files`."""

from __future__ import annotations

import json
from pathlib import Path

from txl_deploy.errors import CheckpointError


def read_corpus_info(path) -> dict:
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointError(path, f"unreadable corpus-info.json ({str(e)[:200]})") from None
    if not isinstance(info, dict):
        raise CheckpointError(path, "corpus-info.json is not a JSON object")
    return info


def check_corpus_info(info: dict, arch: dict, where) -> None:
    size = info.get("vocab_size")
    if size is not None and int(size) != arch["n_token"]:
        raise CheckpointError(where, f"vocab_size {size} but the checkpoint's embedding has {arch['n_token']} rows")
    cutoffs = [int(c) for c in info.get("cutoffs") or []]
    # corpus-info.json lists 0 and the vocabulary size around the cutoffs (train_gpu.py reads [1:-1]).
    inner = cutoffs[1:-1] if cutoffs else []
    if inner != list(arch["cutoffs"]):
        raise CheckpointError(where, f"cutoffs {cutoffs} but the checkpoint's clusters end at "
                                     f"{arch['cutoffs'] + [arch['n_token']]}")
