"""What the Triton Python model (python_model.py) takes from a request, checked, and the parked state it hands back.

Every input is untrusted: tokens, out_positions and tail clusters are refused by their shape, type and range with a
one-line error before the model runs anything on them, and a `resume_state` is read through
runtimes.saved_state (names, headers, sizes and the fingerprint checked before any tensor is read, one row at
most). Nothing here needs Triton: the model's file imports it through PYTHONPATH, as it imports the rest of
txl_deploy, so it needs no copy in the repository.
"""

from __future__ import annotations

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.runtimes.saved_state import archive_bytes, read_saved_state, state_members
from txl_deploy.serving.triton.protocol import (
    RESUME_INPUT,
    STATE_FORMAT,
    STATE_FORMAT_VERSION,
    TAIL_INPUT,
)


def first_line(e: BaseException) -> str:
    """An exception as the one line a response carries."""
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def check_segment(tokens, positions, n_token: int, max_request_tokens: int, state_only: bool = False):
    """`tokens` [1, Q] and `out_positions` [1, P] -> both as contiguous int64; ValueError on anything else. Q may be 0
    only in a request that parks, resumes or asks for tails (`state_only`) and names no positions."""
    if tokens is None or positions is None:
        raise ValueError("requests need the inputs tokens [1, Q] and out_positions [1, P]")
    if tokens.ndim != 2 or tokens.shape[0] != 1:
        raise ValueError(f"tokens must be [1, Q] (one conversation per request), got shape {list(tokens.shape)}")
    q = tokens.shape[1]
    if q < 1:
        if state_only and positions.size == 0:
            return np.zeros((1, 0), np.int64), np.zeros((1, 0), np.int64)
        raise ValueError("tokens is empty")
    if q > max_request_tokens:
        raise ValueError(f"segment of {q} tokens is longer than this server accepts per request "
                         f"({max_request_tokens}); send long prompts in pieces")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= n_token:
        raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {n_token})")
    if positions.ndim != 2 or positions.shape[0] != 1 or positions.shape[1] < 1:
        raise ValueError(f"out_positions must be [1, P] with P >= 1, got shape {list(positions.shape)}")
    if int(positions.min()) < 0 or int(positions.max()) >= q:
        raise ValueError(f"out_positions must index the segment [0, {q}), got {positions.reshape(-1).tolist()[:8]}")
    return np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(positions, dtype=np.int64)


def check_tail_clusters(clusters, n_clusters: int | None):
    """TAIL_INPUT -> the distinct tail clusters asked for (int64 [K]), or None when the request asks for none.
    `n_clusters` is None for a model without an adaptive softmax."""
    if clusters is None:
        return None
    if n_clusters is None:
        raise ValueError(f"{TAIL_INPUT}: this model has no adaptive softmax, so no tail clusters")
    if clusters.ndim != 2 or clusters.shape[0] != 1 or clusters.shape[1] < 1:
        raise ValueError(f"{TAIL_INPUT} must be [1, K] with K >= 1, got shape {list(clusters.shape)}")
    if not np.issubdtype(clusters.dtype, np.integer):
        raise ValueError(f"{TAIL_INPUT} must be INT64 cluster indices, got {clusters.dtype}")
    ids = clusters.reshape(-1)
    if int(ids.min()) < 1 or int(ids.max()) > n_clusters:
        raise ValueError(f"{TAIL_INPUT} must name tail clusters 1..{n_clusters}, got {ids.tolist()[:8]}")
    if np.unique(ids).size != ids.size:
        raise ValueError(f"{TAIL_INPUT} names a cluster twice: {ids.tolist()}")
    return ids.astype(np.int64)


def read_parked(blob, backend):
    """A parked conversation's bytes -> (checked state arrays of one row, its last log-probs [V] or None)."""
    blob = np.ascontiguousarray(blob).reshape(-1)
    if blob.dtype != np.uint8 or blob.size == 0:
        raise ValueError(f"{RESUME_INPUT} must be the UINT8 bytes of a saved conversation state")
    try:
        saved = read_saved_state(blob, backend, max_rows=1)
    except InputError as e:
        raise ValueError(f"{RESUME_INPUT} is not a saved conversation state of this model ({first_line(e)})") \
            from None
    fmt = str(saved.metadata.get("__format__", ""))
    version = int(saved.metadata.get("__format_version__", -1))
    if fmt != STATE_FORMAT or version < 1:
        raise ValueError(f"{RESUME_INPUT} is not a saved conversation state (no '{STATE_FORMAT}' header)")
    if version > STATE_FORMAT_VERSION:
        raise ValueError(f"this conversation state has format version {version}; this server reads up to "
                         f"{STATE_FORMAT_VERSION}: upgrade txl-deploy on the server")
    last = saved.last_log_probs
    return saved.arrays, (None if last is None else last.reshape(-1))


def parked_bytes(backend, arrays, last_log_probs, corrid: int):
    """One conversation's state arrays (one row) and latest log-probs [V] (or None) -> the saved_state output
    (uint8 [1, N]): the members TxlRuntime.save_state writes, which TxlRuntime.load_state reads too, plus a header."""
    members = state_members(backend, arrays, None if last_log_probs is None else last_log_probs[None])
    members["__sequence_id__"] = np.array(corrid, dtype=np.int64)
    members["__format__"] = np.array(STATE_FORMAT)
    members["__format_version__"] = np.array(STATE_FORMAT_VERSION)
    # writable: DLPack cannot export a read-only array
    return np.frombuffer(bytearray(archive_bytes(members)), dtype=np.uint8)[None]
