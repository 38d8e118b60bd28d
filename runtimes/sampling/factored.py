"""The cluster-factored decision of an adaptive softmax: one token chosen from the head, with a tail cluster computed
only when the decision can depend on it.

docs/sampling.md states each rule and proves it (bounds, then exact rejection over blocks). Its promise: it is one
algorithm, whether its tails are computed on demand (`Sampler.start`) or given at once (`Sampler.choose_parts`), so
given bit-identical head and tails it makes the same requests, draws the same uniforms and chooses the same token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError
from txl_deploy.runtimes.sampling.bounds import MASS_MARGIN, power_sum_bound
from txl_deploy.runtimes.sampling.full_row import draw
from txl_deploy.runtimes.sampling.params import SamplingParams
from txl_deploy.runtimes.sampling.processors import Processors

NO_TOKEN_LEFT = "no token is left to choose: the sampling parameters exclude every token"


@dataclass
class Known:
    """Tokens whose log-probs are known: `ids` (contiguous, ascending), their model `log_probs` and their
    processed `scores` (steps 1-5, float64)."""

    ids: np.ndarray
    log_probs: np.ndarray
    scores: np.ndarray


class FactoredDecision:
    """One decision in progress.

    The known set: `known[0]` the shortlist, `known[i]` tail cluster i once revealed. The bounds of what is still
    hidden, per cluster i (at i - 1): `head_log_prob` (log p_head(i): every log-prob of the cluster is at most it),
    `bound` (B_i: every processed score of the cluster is at most it) and `touched_bounds` (f_t(head_i) of the
    cluster's tokens that a step touches). At T > 0 the draw adds the shift `m`, each hidden cluster's largest
    possible weight `top_weight` (b_i) and mass bound `mass` (W_i), and what the filters decided: `excluded` (hidden
    clusters cut whole), `kth` (the top-k cut), `top_p_cut` (known tokens top-p cuts) and `floor` (min-p).

    `run()` is the algorithm: a generator that yields the clusters it needs next (a tuple), is sent {i: tail
    log-probs}, and returns (token, its model log-prob, the top log-probs)."""

    def __init__(self, params: SamplingParams, clusters: Clusters, processors: Processors, head, rng):
        head = np.asarray(head).reshape(-1)
        if head.size != clusters.head_size:
            raise InputError(f"head log-probs have {head.size} entries, the head {clusters.shortlist} "
                             f"shortlist tokens and {clusters.n_clusters} clusters")
        self.params, self.clusters, self.processors, self.rng = params, clusters, processors, rng
        short = np.arange(clusters.shortlist)
        raw = head[:clusters.shortlist]
        self.known = {0: Known(short, raw, processors.on(short, raw))}
        n = clusters.n_clusters
        self.head_log_prob = np.array([float(head[clusters.head_column(i)]) for i in range(1, n + 1)])
        self.bound = np.empty(n)
        self.touched_bounds = []
        touched = processors.touched
        for i, (lo, hi) in enumerate(clusters.bounds, start=1):
            t = touched[(touched >= lo) & (touched < hi)]
            fb = processors.on(t, np.full(t.size, self.head_log_prob[i - 1]))
            self.touched_bounds.append(fb)
            self.bound[i - 1] = max(self.head_log_prob[i - 1], float(fb.max())) if fb.size else \
                self.head_log_prob[i - 1]
        # a constraint's mask only lowers scores to -inf, so the bounds above still hold; a cluster it closes whole
        # holds no candidate: bound -inf, so no rule reveals it and its mass bound is 0
        self.closed = set() if processors.allowed is None else \
            {i for i, (lo, hi) in enumerate(clusters.bounds, start=1) if not processors.allowed[lo:hi].any()}
        for i in self.closed:
            self.bound[i - 1] = -np.inf

    # -- the known set and what is hidden -------------------------------------------------------------------------
    def hidden(self) -> list[int]:
        return [i for i in range(1, self.clusters.n_clusters + 1) if i not in self.known]

    def reveal(self, i: int, tail_log_probs) -> None:
        lo, hi = self.clusters.bounds[i - 1]
        ids = np.arange(lo, hi)
        self.known[i] = Known(ids, tail_log_probs, self.processors.on(ids, tail_log_probs))

    def _ask(self, needed):
        given = yield tuple(needed)
        for i in needed:
            self.reveal(i, given[i])

    def _known_log_probs(self):
        parts = sorted(self.known)
        return (np.concatenate([self.known[k].ids for k in parts]),
                np.concatenate([self.known[k].log_probs for k in parts]))

    # -- the decision -----------------------------------------------------------------------------------------------
    def run(self):
        tok = yield from (self._greedy() if self.params.greedy else self._sample())
        top = []
        n = self.params.logprobs or 0
        if n:  # a hidden cluster's tokens are all <= its head log-prob: it matters only if that reaches the n-th
            _, k_lp = self._known_log_probs()
            nth = -np.inf if k_lp.size < n else -float(np.partition(-k_lp.astype(np.float64), n - 1)[n - 1])
            need = [i for i in self.hidden() if self.head_log_prob[i - 1] >= nth]
            if need:
                yield from self._ask(need)
            ids, lps = self._known_log_probs()
            order = np.lexsort((ids, -lps.astype(np.float64)))[:n]  # most likely first, ties in id order
            top = [(int(ids[j]), float(lps[j])) for j in order]
        part = self.known[self.clusters.cluster_of(tok)]
        return tok, float(part.log_probs[tok - part.ids[0]]), top

    def _greedy(self):
        """The first maximum: a hidden cluster can hold it only if its bound beats the best known score, or equals
        it with lower ids than the best known token's."""
        c, bound = self.clusters, self.bound
        while True:
            best, best_id = -np.inf, -1
            for k in sorted(self.known):
                part = self.known[k]
                j = int(np.argmax(part.scores))
                if part.scores[j] > best:
                    best, best_id = float(part.scores[j]), int(part.ids[j])
            can = [i for i in self.hidden() if bound[i - 1] > best or
                   (bound[i - 1] == best and best > -np.inf and c.bounds[i - 1][0] < best_id)]
            if not can:
                break
            yield from self._ask([max(can, key=lambda i: (bound[i - 1], -i))])
        if best_id < 0:
            raise InputError(NO_TOKEN_LEFT)
        return best_id

    # -- T > 0: the filters from bounds, then exact rejection over blocks -------------------------------------------
    def _scaled(self):
        """The processed scores / T of every known part (computed once per part)."""
        for k, part in self.known.items():
            if k not in self.x:
                self.x[k] = part.scores / self.params.temperature

    def _reveal_scaled(self, needed):
        yield from self._ask(needed)
        self._scaled()

    def _known_x(self):
        return np.concatenate([self.x[k] for k in sorted(self.x)])

    def _weights(self, k):
        """Part k's weights exp(x - m), with the top-k cut."""
        s = self.x[k] if self.kth == -np.inf else np.where(self.x[k] < self.kth, -np.inf, self.x[k])
        return np.exp(s - self.m)

    def _final(self, k):
        """Part k's weights after every filter."""
        w = self._weights(k)
        if k in self.top_p_cut:
            w = np.where(self.top_p_cut[k], 0.0, w)
        return np.where(w < self.floor, 0.0, w) if self.floor > 0 else w  # (weights are >= 0: a 0 floor cuts nothing)

    def _sample(self):
        p, c, T = self.params, self.clusters, self.params.temperature
        self.x = {}
        self._scaled()
        self.xb = self.bound / T
        # the shift m: from the head alone, >= every scaled score (so no weight overflows)
        self.m = max(float(np.max(self.x[0])) if self.x[0].size else -np.inf, float(np.max(self.xb)))
        if not self.m > -np.inf:
            raise InputError(NO_TOKEN_LEFT)
        self.excluded = set(self.closed)
        self.kth, self.top_p_cut, self.floor = -np.inf, {}, 0.0
        if p.top_k is not None and p.top_k < c.n_token:
            yield from self._top_k()
        # per hidden cluster: the largest weight b_i one token can have, and the mass bound W_i
        self.top_weight = np.exp(self.xb - self.m)
        self.mass = np.array([(1 + MASS_MARGIN) * (math.exp(self.head_log_prob[i] / T - self.m)
                                                   * power_sum_bound(hi - lo, T)
                                                   + float(np.sum(np.exp(self.touched_bounds[i] / T - self.m))))
                              for i, (lo, hi) in enumerate(c.bounds)])
        self.mass[[i - 1 for i in self.closed]] = 0.0
        if p.top_p < 1:
            yield from self._top_p()
        if p.min_p > 0:
            yield from self._min_p()
        return (yield from self._draw())

    def _top_k(self):
        """The k-th largest known score is <= the true k-th; a hidden cluster below it holds none of the top k."""
        k, xb = self.params.top_k, self.xb
        while True:
            kx = self._known_x()
            self.kth = -np.inf if kx.size < k else float(np.partition(kx, kx.size - k)[kx.size - k])
            can = [i for i in self.hidden() if xb[i - 1] >= self.kth and i not in self.closed]
            if not can:
                break
            yield from self._reveal_scaled([max(can, key=lambda i: (xb[i - 1], -i))])
        self.excluded.update(self.hidden())

    def _top_p(self):
        """Reveal the heaviest hidden cluster until every known token and hidden cluster is surely kept or cut."""
        p, tb, mass = self.params, self.top_weight, self.mass
        while True:
            live = [i for i in self.hidden() if i not in self.excluded]
            parts = sorted(self.x)
            w = np.concatenate([self._weights(k) for k in parts])
            kid = np.concatenate([self.known[k].ids for k in parts])
            order = np.lexsort((kid, -w))
            ranked = np.cumsum(w[order])
            before = np.concatenate([[0.0], ranked[:-1]])
            total_lo = ranked[-1]
            total_hi = total_lo + sum(mass[i - 1] for i in live)
            wr = w[order]
            unknown_before = np.zeros(wr.size)
            for i in live:
                unknown_before += np.where(tb[i - 1] >= wr, mass[i - 1], 0.0)
            kept = before + unknown_before < p.top_p * total_lo
            gone = before >= p.top_p * total_hi
            settled = [i for i in live
                       if (ranked[np.count_nonzero(wr > tb[i - 1]) - 1] if np.any(wr > tb[i - 1]) else 0.0)
                       >= p.top_p * total_hi]
            if (kept | gone).all() and len(settled) == len(live):
                break
            yield from self._reveal_scaled([max(live, key=lambda i: (mass[i - 1], -i))])
        self.excluded.update(live)
        mask = np.zeros(w.size, dtype=bool)
        mask[order] = gone
        start = 0
        for k in parts:
            self.top_p_cut[k] = mask[start:start + self.known[k].ids.size]
            start += self.known[k].ids.size

    def _min_p(self):
        """The cut is min_p times the largest weight: exact once no hidden cluster can beat the known maximum."""
        while True:
            top = float(np.max(self._known_x()))
            can = [i for i in self.hidden() if i not in self.excluded and self.xb[i - 1] > top]
            if not can:
                break
            yield from self._reveal_scaled([max(can, key=lambda i: (self.xb[i - 1], -i))])
        self.floor = self.params.min_p * math.exp(top - self.m)  # top-k and top-p keep the most likely token
        self.excluded.update(i for i in self.hidden() if self.top_weight[i - 1] < self.floor)

    def _draw(self):
        """Blocks in id order (known tokens, a hidden cluster's mass bound W_i, an excluded one's 0); a hidden
        cluster drawn is revealed and accepted with probability S_i / W_i, then drawn inside."""
        n = self.clusters.n_clusters
        while True:
            blocks = [self._final(k) if k in self.known else
                      np.array([0.0 if k in self.excluded else self.mass[k - 1]]) for k in range(n + 1)]
            lens = [b.size for b in blocks]
            flat = np.concatenate(blocks)
            cum = np.cumsum(flat)
            if not cum[-1] > 0:
                raise InputError(NO_TOKEN_LEFT)
            at = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
            if at >= flat.size or not flat[at] > 0:  # a rounding past the end: the last block with mass
                at = min(at, int(np.flatnonzero(flat > 0)[-1]))
            k, start = 0, 0
            while at >= start + lens[k]:
                start += lens[k]
                k += 1
            if k in self.known:
                return int(self.known[k].ids[at - start])
            yield from self._reveal_scaled([k])
            w = self._final(k)
            inner = float(np.cumsum(w)[-1])
            if self.rng.random() * self.mass[k - 1] < inner:
                return int(self.known[k].ids[0]) + draw(w, self.rng.random())


__all__ = ["FactoredDecision", "Known", "NO_TOKEN_LEFT"]
