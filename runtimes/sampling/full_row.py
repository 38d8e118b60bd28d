"""The full-row draw (steps 6-8 of docs/sampling.md): the filters on a whole distribution's scores, the
inverse-CDF draw, and the top log-probs reported with a token."""

from __future__ import annotations

import numpy as np


def filtered_weights(scores: np.ndarray, temperature: float, top_k=None, top_p: float = 1.0,
                     min_p: float = 0.0) -> np.ndarray:
    """Steps 6-7: the unnormalised probabilities exp((s - max) / T) of the tokens top_k, top_p and min_p leave (the
    others 0). The most likely token always stays."""
    s = np.asarray(scores, dtype=np.float64) / temperature
    if top_k is not None and top_k < s.size:
        kth = np.partition(s, s.size - top_k)[s.size - top_k]
        s = np.where(s < kth, -np.inf, s)
    w = np.exp(s - s.max())
    if top_p < 1:
        order = np.lexsort((np.arange(w.size), -w))  # most likely first, ties in id order
        ranked = np.cumsum(w[order])
        before = np.concatenate([[0.0], ranked[:-1]])  # the weight of the more likely tokens
        cut = np.zeros(w.size, dtype=bool)
        cut[order] = before >= top_p * ranked[-1]
        w = np.where(cut, 0.0, w)
    if min_p > 0:
        w = np.where(w < min_p * w.max(), 0.0, w)
    return w


def draw(weights: np.ndarray, u: float) -> int:
    """Step 8: the first token whose running sum of weights exceeds u times their total."""
    cum = np.cumsum(weights)
    return int(min(np.searchsorted(cum, u * cum[-1], side="right"), weights.size - 1))


def top_logprobs(log_probs: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The n most likely tokens and their log-probs, most likely first (ties in id order)."""
    lp = np.asarray(log_probs)
    if n <= 0:
        return []
    n = min(n, lp.size)
    part = np.argpartition(-lp, n - 1)[:n] if n < lp.size else np.arange(lp.size)
    part = part[np.lexsort((part, -lp[part]))]
    return [(int(i), float(lp[i])) for i in part]



__all__ = ["filtered_weights", "draw", "top_logprobs"]
