"""Choosing the next token from a distribution of log-probabilities."""

from __future__ import annotations

import numpy as np


def sample(log_probs: np.ndarray, temperature: float, top_k, top_p, rng: np.random.Generator) -> int:
    """One token from a log-distribution. Deterministic for a given rng state on every platform (no BLAS)."""
    lp = np.asarray(log_probs, dtype=np.float64)
    if temperature == 0:
        return int(np.argmax(lp))
    logits = lp / temperature
    if top_k is not None and top_k < logits.size:
        kth = np.partition(logits, -top_k)[-top_k]
        logits = np.where(logits < kth, -np.inf, logits)
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if top_p is not None and top_p < 1:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = cum - probs[order] < top_p  # always keeps the most likely token
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[keep]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    return int(min(np.searchsorted(np.cumsum(probs), rng.random(), side="right"), probs.size - 1))
