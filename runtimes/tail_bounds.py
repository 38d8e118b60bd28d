"""The bounds that let a sampler skip an adaptive softmax's tail clusters (the layout: contract/clusters.py).

An adaptive softmax (Grave et al., 2017; Transformer-XL's ProjectedAdaptiveLogSoftmax) scores a shortlist of
tokens [0, cutoffs[0]) and one logit per tail cluster in its head; token t of tail cluster i has
log p(t) = log p_head(i) + log p_i(t | i) <= log p_head(i), since a log-softmax is <= 0 (also in floating point:
x + y with y <= 0 is <= x). The bounds here turn that into upper bounds of what a cluster can contribute to a
decision, so a sampler can leave the cluster uncomputed when no bound can change what it chooses
(docs/sampling.md has the proofs).
"""

from __future__ import annotations

# Relative slack on a cluster's mass bound: float32 log-probs of a tail may sum to slightly above its head
# probability (a few ulp), and the rejection step needs a bound that holds in floating point.
MASS_MARGIN = 1e-4


def power_sum_bound(n: int, temperature: float) -> float:
    """An upper bound of sum_t p_t^(1/T) over n probabilities that sum to at most 1: 1 for T <= 1 (each
    p^(1/T) <= p), n^(1 - 1/T) for T > 1 (Hoelder's inequality, the largest when all n are equal)."""
    return 1.0 if temperature <= 1 else float(n) ** (1.0 - 1.0 / temperature)
