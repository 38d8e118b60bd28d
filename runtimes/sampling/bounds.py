"""Bounds of what a hidden tail cluster can contribute to a decision (docs/sampling.md, "Why a tail can be skipped").

Every token t of tail cluster i has log p(t) <= log p_head(i) (a log-softmax is <= 0, also in floating point), so
these turn the head column into upper bounds of a cluster's scores and of its filtered mass.
"""

from __future__ import annotations

# Relative slack on a cluster's mass bound: float32 log-probs of a tail may sum to slightly above its head
# probability (a few ulp), and the rejection step needs a bound that holds in floating point.
MASS_MARGIN = 1e-4


def power_sum_bound(n: int, temperature: float) -> float:
    """An upper bound of sum_t p_t^(1/T) over n probabilities that sum to at most 1: 1 for T <= 1 (each
    p^(1/T) <= p), n^(1 - 1/T) for T > 1 (Hoelder's inequality, the largest when all n are equal)."""
    return 1.0 if temperature <= 1 else float(n) ** (1.0 - 1.0 / temperature)


__all__ = ["MASS_MARGIN", "power_sum_bound"]
