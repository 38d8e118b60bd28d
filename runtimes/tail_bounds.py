"""The adaptive softmax's layout as a sampler sees it, and the bounds that let it skip tail clusters.

An adaptive softmax (Grave et al., 2017; Transformer-XL's ProjectedAdaptiveLogSoftmax) scores a shortlist of
tokens [0, cutoffs[0]) and one logit per tail cluster in its head; token t of tail cluster i has
log p(t) = log p_head(i) + log p_i(t | i) <= log p_head(i), since a log-softmax is <= 0 (also in floating point:
x + y with y <= 0 is <= x). The bounds here turn that into upper bounds of what a cluster can contribute to a
decision, so a sampler can leave the cluster uncomputed when no bound can change what it chooses
(docs/sampling.md has the proofs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from txl_deploy.errors import InputError

# Relative slack on a cluster's mass bound: float32 log-probs of a tail may sum to slightly above its head
# probability (a few ulp), and the rejection step needs a bound that holds in floating point.
MASS_MARGIN = 1e-4


@dataclasses.dataclass(frozen=True)
class Clusters:
    """Where the tail clusters lie: tokens [0, shortlist) are in the head; tail cluster i = 1..n covers
    bounds[i - 1] = (lo, hi)."""

    shortlist: int
    bounds: list[tuple[int, int]]

    @property
    def n(self) -> int:
        return len(self.bounds)

    @property
    def n_token(self) -> int:
        return self.bounds[-1][1]

    def head_column(self, i: int) -> int:
        """Cluster i's column in the head: the original code's `head_logprob[:, -i]` (the cluster logits are
        stored after the shortlist in reverse order)."""
        return self.shortlist + self.n - i

    @classmethod
    def of(cls, config) -> Clusters | None:
        """The layout of a model's config; None for a plain softmax."""
        if config.n_clusters == 0:
            return None
        ends = list(config.cutoffs) + [config.n_token]
        return cls(int(ends[0]), [(int(lo), int(hi)) for lo, hi in itertools.pairwise(ends)])

    def head_from_full(self, log_probs) -> np.ndarray:
        """The head [shortlist + n] of a full distribution [V]: the shortlist's log-probs, and per cluster the
        log of its tokens' total probability (float64, a max-shifted log-sum-exp)."""
        lp = np.asarray(log_probs, dtype=np.float64).reshape(-1)
        if lp.size != self.n_token:
            raise InputError(f"log-probs have {lp.size} entries, the vocabulary {self.n_token}")
        head = np.empty(self.shortlist + self.n, dtype=np.float64)
        head[:self.shortlist] = lp[:self.shortlist]
        for i, (lo, hi) in enumerate(self.bounds, start=1):
            head[self.head_column(i)] = log_sum_exp(lp[lo:hi])
        return head


def log_sum_exp(x: np.ndarray) -> float:
    top = float(np.max(x))
    if not math.isfinite(top):
        return top
    return top + math.log(float(np.sum(np.exp(x - top))))


def power_sum_bound(n: int, temperature: float) -> float:
    """An upper bound of sum_t p_t^(1/T) over n probabilities that sum to at most 1: 1 for T <= 1 (each
    p^(1/T) <= p), n^(1 - 1/T) for T > 1 (Hoelder's inequality, the largest when all n are equal)."""
    return 1.0 if temperature <= 1 else float(n) ** (1.0 - 1.0 / temperature)
