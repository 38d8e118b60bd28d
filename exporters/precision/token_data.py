"""Token ids from the user's files: calibration data and held-out text for the reduced-precision checks."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from txl_deploy.errors import InputError


# -- token ids from the user's files ---------------------------------------------------------------------------
def read_token_ids(path, vocab, n_token: int, what: str = "calibration data") -> np.ndarray:
    """A text file (tokenized with the model's vocabulary, as `txl-deploy eval` reads it) or a .npy of token ids ->
    int64 ids."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: {what} not found")
    if path.suffix.lower() == ".npy":
        try:
            # never unpickle user data; memory-mapped, so a header that claims more than the file holds is refused
            # by the mapping instead of allocated
            ids = np.load(path, allow_pickle=False, mmap_mode="r")
        except Exception as e:
            raise InputError(f"{path}: not a readable .npy of token ids ({type(e).__name__})") from None
        if not np.issubdtype(ids.dtype, np.integer):
            raise InputError(f"{path}: {what} must hold integer token ids, got dtype {ids.dtype}")
        ids = np.array(ids.reshape(-1), dtype=np.int64)  # a copy of what the file holds, then the map is closed
    else:
        if vocab is None:
            raise InputError(f"{path}: the model has no vocabulary to tokenize text with; pass a .npy of token ids")
        try:
            # as the model's corpus was read: for a byte-level (enwik8) model the raw bytes, newlines dropped
            ids, _ = vocab.encode_corpus(path.read_bytes())
        except InputError as e:
            raise InputError(f"{path}: {what}: {e} (or pass a .npy of token ids)") from None
    if ids.size and (ids.min() < 0 or ids.max() >= n_token):
        bad = int(ids.min() if ids.min() < 0 else ids.max())
        raise InputError(f"{path}: token id {bad} is outside the vocabulary [0, {n_token})")
    return ids


def segment_len(info) -> int:
    """The segment length of calibration and evaluation: the model's training segment, as far as the graph takes."""
    return max(1, min(int(info.config.tgt_len or 1), info.max_segment))


def ids_from(data, info, what, path_hint="<array>"):
    if data is None:
        return None
    if isinstance(data, (str, Path)):
        return read_token_ids(data, info.vocab, info.config.n_token, what), str(data)
    ids = np.asarray(data).reshape(-1)
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"{what}: token ids must be integers, got dtype {ids.dtype}")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= info.config.n_token):
        raise InputError(f"{what}: token id outside the vocabulary [0, {info.config.n_token})")
    return ids, path_hint


def check_long_enough(ids, seg: int, name: str, what: str):
    if ids.size < seg + 1:
        raise InputError(f"{name}: {what} has {ids.size} tokens, shorter than one segment of {seg} tokens "
                         f"(+1 to predict); give more text")
