"""The stream every verification feeds: a random token stream cut into segments that cover what can go wrong in a
stateful export (a partly empty memory, decode steps, prefills, the ring wrapping around)."""

from __future__ import annotations

import numpy as np


def verification_segments(mem_len: int, max_segment: int) -> list[int]:
    """Segment lengths: prefill into an empty memory, decode steps, a prefill that wraps the ring, decode again."""
    wrap = min(max_segment, mem_len + 2)
    segs = [min(3, max_segment), 1, 1, min(5, max_segment), wrap, 1, min(2, max_segment), 1]
    while sum(segs) <= mem_len + 1:  # make sure the ring wraps even when max_segment < mem_len
        segs.append(min(max_segment, mem_len))
    return segs


def stream_tokens(n_token: int, segments, batch: int = 2, seed: int = 0) -> np.ndarray:
    """The random stream [batch, sum(segments)] every comparison feeds."""
    return np.random.default_rng(seed).integers(0, n_token, size=(batch, sum(segments)), dtype=np.int64)
