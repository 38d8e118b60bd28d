"""The adaptive softmax's layout: the one description every layer reads (model, parts, sampler, Triton, web page).

An adaptive softmax (Grave et al., 2017; Transformer-XL's `ProjectedAdaptiveLogSoftmax`) scores a shortlist of tokens
[0, cutoffs[0]) and one logit per tail cluster in its head; tail cluster i = 1..n covers the ids [lo_i, hi_i), and
log p(t) = log p_head(column of i) + log p_i(t | i). The head stores the cluster logits after the shortlist in reverse
order (the original code's `head_logprob[:, -i]`): cluster i is column `shortlist + n - i`. docs/sampling.md says
how a sampler uses it. numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from txl_deploy.errors import InputError


def pieces(cutoffs, n_token: int) -> list[tuple[int, int]]:
    """[lo, hi) of the vocabulary's pieces: the head's shortlist (index 0, the whole vocabulary without cutoffs)
    and tail clusters 1..n, as the adaptive input and softmax split their weights."""
    ends = [0] + [int(c) for c in cutoffs] + [int(n_token)]
    return list(zip(ends[:-1], ends[1:]))


@dataclass(frozen=True)
class Clusters:
    """Where the tail clusters lie: tokens [0, shortlist) are in the head; tail cluster i = 1..n_clusters covers
    `bounds[i - 1]` = [lo, hi)."""

    shortlist: int
    bounds: tuple[tuple[int, int], ...]

    def __post_init__(self):
        bounds = tuple((int(lo), int(hi)) for lo, hi in self.bounds)
        object.__setattr__(self, "shortlist", int(self.shortlist))
        object.__setattr__(self, "bounds", bounds)
        ends = [0, self.shortlist] + [hi for _, hi in bounds]
        if not bounds or any(lo != end for (lo, _), end in zip(bounds, ends[1:])) or \
                any(a >= b for a, b in zip(ends, ends[1:])):
            raise ValueError(f"an adaptive softmax's clusters follow the shortlist [0, {self.shortlist}) without "
                             f"gaps, each non-empty: got {list(bounds)}")

    @classmethod
    def from_cutoffs(cls, cutoffs, n_token: int) -> Clusters | None:
        """The layout of these cutoffs (the config's, or Triton's published list); None for none (plain softmax)."""
        if not len(cutoffs):
            return None
        return cls(int(cutoffs[0]), tuple(pieces(cutoffs, n_token)[1:]))

    @classmethod
    def of(cls, config) -> Clusters | None:
        """The layout of a model's config; None for a plain softmax."""
        return cls.from_cutoffs(config.cutoffs, config.n_token)

    @property
    def n_clusters(self) -> int:
        return len(self.bounds)

    @property
    def n_token(self) -> int:
        return self.bounds[-1][1]

    @property
    def head_size(self) -> int:
        """The head's width: the shortlist's tokens, then one column per cluster."""
        return self.shortlist + self.n_clusters

    @property
    def cutoffs(self) -> list[int]:
        return [lo for lo, _ in self.bounds]

    def head_column(self, i: int) -> int:
        """Cluster i's column in the head (i = 1..n_clusters): the original code's column -i."""
        if not 1 <= i <= self.n_clusters:
            raise InputError(f"tail cluster {i} does not exist (the model has {self.n_clusters})")
        return self.shortlist + self.n_clusters - i

    def cluster_of(self, token: int) -> int:
        """The tail cluster holding a token id (0: the shortlist)."""
        return int(np.searchsorted([hi for _, hi in self.bounds], token, side="right")) + 1 \
            if token >= self.shortlist else 0

    def head_from_full(self, log_probs) -> np.ndarray:
        """The head [..., shortlist + n] float32 (the head graph's dtype) of full distributions [..., V]: the
        shortlist's log-probs and, per cluster, the log of its tokens' total probability (a float64 max-shifted
        log-sum-exp rounded once to float32: at least the cluster's largest log-prob, so still a bound of its
        tokens; a cluster the model rules out stays -inf)."""
        lp = np.asarray(log_probs)
        if lp.ndim == 0 or lp.shape[-1] != self.n_token:
            raise InputError(f"log-probs have {lp.shape[-1] if lp.ndim else 1} entries per row, the vocabulary "
                             f"{self.n_token}")
        head = np.empty(lp.shape[:-1] + (self.head_size,), dtype=np.float32)
        head[..., :self.shortlist] = lp[..., :self.shortlist]
        for i, (lo, hi) in enumerate(self.bounds, start=1):
            head[..., self.head_column(i)] = log_sum_exp(np.asarray(lp[..., lo:hi], dtype=np.float64))
        return head

    def compose(self, head, tails) -> np.ndarray:
        """The full log-probs [..., V] from the head [..., shortlist + n] and every tail (tails[i - 1] [..., hi -
        lo], the cluster's full log-probs): the exported graph's composition, float32."""
        head = np.asarray(head)
        if len(tails) != self.n_clusters:
            raise InputError(f"{len(tails)} tails given, the model has {self.n_clusters} clusters")
        return np.concatenate([head[..., :self.shortlist], *tails], axis=-1).astype(np.float32, copy=False)

    def to_dict(self) -> dict:
        """The layout as a page or a client reads it (JSON): the shortlist, each cluster's [lo, hi), and each
        cluster's head column."""
        return {"shortlist": self.shortlist, "bounds": [list(b) for b in self.bounds],
                "head_columns": [self.head_column(i) for i in range(1, self.n_clusters + 1)]}


def log_sum_exp(x: np.ndarray) -> np.ndarray | float:
    """log(sum(exp(x))) over the last axis in float64, max-shifted (numpy's pairwise sum); -inf where every entry
    is -inf."""
    x = np.asarray(x, dtype=np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        out = (safe + np.log(np.sum(np.exp(x - safe), axis=-1, keepdims=True)))[..., 0]
    return float(out) if out.ndim == 0 else out


__all__ = ["Clusters", "pieces", "log_sum_exp"]
