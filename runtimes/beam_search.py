"""Beam search behind `TxlRuntime.beam_search`: k beams as k rows of the memory, reordered in place each step.

The search is HuggingFace's `generate(num_beams=k, do_sample=False)` (transformers 4.56 `_beam_search`), restated
for one stream (docs/beam_search.md says what equals it and to what tolerance):
- each step takes the K = max(2, 1 + number of stop ids) * k best continuations of all beams by accumulated
  log-prob (the first step from the prompt alone: beams 1..k-1 start at -1e9);
- a continuation ending in a stop id, or reaching max_new_tokens, finishes; only the first k of the K may enter the
  k finished hypotheses, scored `sum log p / generated_length ** length_penalty` (the stop id counts);
- the k best unfinished continuations run on: their rows of the memory are selected (`Backend.select_rows`) and
  fed their new tokens;
- the search ends when no continuation is left, when every finished slot is full and early_stopping is True, or
  when the best running beam, at the best length it could reach (its current length; max_new_tokens where
  early_stopping is "never" and length_penalty > 0), cannot beat the worst finished one.
Scores are float32 throughout, as in HF.

With the adaptive softmax's parts (`backend.clusters`, lazy runtimes), a step computes every beam's head and only
the tails that can hold one of the K best: every token of tail cluster i has log p <= the head's column for i, so a
beam's cluster whose `score + head column` is below the K-th best known candidate holds none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.runtimes.arguments import is_real, whole
from txl_deploy.runtimes.decoding import feed_head
from txl_deploy.runtimes.lazy_decode import full_log_probs

# HF's stand-in for "no score": unused beam slots start there, and a finished continuation gets it added so that it
# does not run on. Kept identical, float32, so that the same candidates win at every step.
NO_SCORE = np.float32(-1e9)
EARLY_STOPPING = (True, False, "never")


class Beam(NamedTuple):
    """One hypothesis: the generated token ids (without the prompt; a stop id that ended it is the last one) and
    its score, `sum of their log-probs / len(tokens) ** length_penalty`."""

    tokens: list
    score: float


@dataclass(frozen=True)
class BeamParams:
    num_beams: int
    max_new_tokens: int
    length_penalty: float
    early_stopping: bool | str
    num_return_sequences: int
    stop: tuple

    @classmethod
    def checked(cls, n_token: int, num_beams, max_new_tokens, length_penalty, early_stopping,
                num_return_sequences, stop) -> "BeamParams":
        num_beams = whole("num_beams", num_beams, lo=2)
        if num_beams > n_token:
            raise InputError(f"num_beams must be at most the vocabulary's size ({n_token}), got {num_beams}")
        max_new_tokens = whole("max_new_tokens", max_new_tokens, lo=1)
        if not is_real(length_penalty) or not np.isfinite(length_penalty):
            raise InputError(f"length_penalty must be a finite number, got {length_penalty!r}")
        if not any(early_stopping is m or (isinstance(m, str) and early_stopping == m) for m in EARLY_STOPPING):
            raise InputError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
        num_return_sequences = whole("num_return_sequences", num_return_sequences, lo=1)
        if num_return_sequences > num_beams:
            raise InputError(f"num_return_sequences ({num_return_sequences}) must be at most num_beams ({num_beams})")
        ids = () if stop is None else (stop,) if isinstance(stop, (int, np.integer)) else tuple(stop)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < n_token:
                raise InputError(f"stop token {t!r} is not an id in the vocabulary [0, {n_token})")
        return cls(num_beams, max_new_tokens, float(length_penalty), early_stopping, num_return_sequences,
                   tuple(sorted({int(t) for t in ids})))

    @property
    def candidates(self) -> int:
        """K: enough continuations that k of them are unfinished even when every beam's best ones are stop ids."""
        return max(2, 1 + len(self.stop)) * self.num_beams


def best_first(values: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest values, largest first, ties to the lower index; linear in len(values) (a step's
    k x V candidates of a 267k-word vocabulary are a million)."""
    if n < values.size:
        kth = np.partition(values, values.size - n)[values.size - n]
        above, tied = np.flatnonzero(values > kth), np.flatnonzero(values == kth)
        idx = np.concatenate([above, tied[:n - above.size]])
    else:
        idx = np.arange(values.size)
    return idx[np.lexsort((idx, -values[idx]))]


def penalised(score, length: int, length_penalty: float):
    """A score divided by length ** length_penalty in float32, as HF divides its float32 tensor by a Python float."""
    return np.float32(score) / np.float32(float(length) ** length_penalty)


def run_beam_search(rt, ids, params: BeamParams) -> list[Beam]:
    """Feed `ids` [1, Q] (checked; None continues from the runtime's last distribution), search, and return the
    num_return_sequences best hypotheses, best first. The caller holds the lock. The stream is left as it was after
    the prompt (one row, its last distribution), whatever the beams did."""
    backend = rt.backend
    lazy = rt.lazy and backend.clusters is not None
    if ids is None:
        first = ("full", rt._last_log_probs[:1])
    elif lazy:
        first = ("parts",) + feed_head(rt, ids)
    else:
        first = ("full", rt.prefill(ids))
    saved = {k: np.array(v, copy=True) for k, v in backend.state_arrays(rt._state).items()}
    try:
        return _search(rt, first, params, lazy)
    finally:
        rt._state = backend.state_from_arrays(saved, copy=False)
        rt._last_log_probs = first[1] if first[0] == "full" else full_log_probs(backend, *first[1:])


def _search(rt, dist, p: BeamParams, lazy: bool) -> list[Beam]:
    k, n_token = p.num_beams, rt.n_token
    K = min(p.candidates, k * n_token)  # many stop ids on a small vocabulary: every continuation
    running = [[] for _ in range(k)]
    running_scores = np.full(k, NO_SCORE, dtype=np.float32)
    running_scores[0] = 0.0  # the beams are copies of one prompt: only the first may start
    finished: list[list] = [[] for _ in range(k)]
    finished_scores = np.full(k, NO_SCORE, dtype=np.float32)
    finished_full = np.zeros(k, dtype=bool)
    stop = np.asarray(p.stop, dtype=np.int64)
    dist = tuple(dist[:1]) + tuple(np.repeat(a, k, axis=0) for a in dist[1:])  # the prompt's row, once per beam
    for t in range(p.max_new_tokens):
        acc = _accumulated(rt, dist, running_scores, K)
        flat = acc.reshape(-1)
        top = best_first(flat, K)
        beam, token, score = top // n_token, top % n_token, flat[top]
        ends = np.isin(token, stop) | (t + 1 >= p.max_new_tokens)
        # the k best continuations that do not end run on
        masked = score + ends.astype(np.float32) * NO_SCORE
        keep = best_first(masked, k)
        # the first k continuations that end are hypotheses; the k best of old and new are kept
        new_scores = penalised(score, t + 1, p.length_penalty) + (~(ends & (np.arange(K) < k))) * NO_SCORE
        merged = np.concatenate([finished_scores, new_scores.astype(np.float32)])
        best = best_first(merged, k)
        hypotheses = finished + [running[b] + [int(x)] for b, x in zip(beam, token)]
        done = np.concatenate([finished_full, ends & (np.arange(K) < k)])
        finished, finished_scores, finished_full = [hypotheses[i] for i in best], merged[best], done[best]
        running = [running[beam[j]] + [int(token[j])] for j in keep]
        running_scores = masked[keep].astype(np.float32)
        if _finished(p, t + 1, running_scores, finished_scores, finished_full) or ends.all():
            break
        # each beam's memory row is the one it continues, then its new token is fed
        rt._state = rt.backend.select_rows(rt._state, beam[keep].astype(np.int64) if t else np.zeros(k, np.int64))
        fed = token[keep].reshape(k, 1).astype(np.int64)
        dist = ("parts",) + feed_head(rt, fed) if lazy else ("full", rt._feed(fed, want="last"))
    order = range(p.num_return_sequences)
    return [Beam(finished[i], float(finished_scores[i])) for i in order]


def _finished(p: BeamParams, generated: int, running_scores, finished_scores, finished_full) -> bool:
    """Whether the search ends after `generated` tokens: every slot holds a hypothesis and early_stopping is True,
    or the best running beam cannot beat the worst hypothesis (HF's heuristic, one stream)."""
    if finished_full.all() and p.early_stopping is True:
        return True
    length = p.max_new_tokens if p.early_stopping == "never" and p.length_penalty > 0 else generated
    best_possible = penalised(running_scores[0], length, p.length_penalty)
    worst = np.where(finished_full, finished_scores.min(), NO_SCORE)
    return not bool((best_possible > worst).any())


def _accumulated(rt, dist, running_scores, K: int) -> np.ndarray:
    """Each beam's score plus each token's log-prob [k, V] float32: every value where the distribution is full; with
    the softmax's parts, -inf where a tail cluster cannot hold one of the K best (and is not computed)."""
    if dist[0] == "full":
        return dist[1].astype(np.float32, copy=False) + running_scores[:, None]
    hidden, head = dist[1], dist[2]
    backend, clusters = rt.backend, rt.backend.clusters
    k, S = head.shape[0], clusters.shortlist
    acc = np.full((k, rt.n_token), -np.inf, dtype=np.float32)
    acc[:, :S] = head[:, :S] + running_scores[:, None]
    hidden_tails = np.ones((k, clusters.n_clusters), dtype=bool)
    columns = [clusters.head_column(i) for i in range(1, clusters.n_clusters + 1)]
    bounds = head[:, columns] + running_scores[:, None]  # float addition is monotone: a bound of every token's sum
    rt.tail_stats["decisions"] += k
    while True:
        flat = acc.reshape(-1)
        kth = np.partition(flat, flat.size - K)[flat.size - K]  # the K-th best known (-inf while fewer are known)
        wanted = hidden_tails & (bounds >= kth) & (bounds > -np.inf)
        if not wanted.any():
            return acc
        for i in np.flatnonzero(wanted.any(axis=0)) + 1:
            rows = np.flatnonzero(wanted[:, i - 1])
            lo, hi = clusters.bounds[i - 1]
            tail = backend.run_tail(int(i), np.ascontiguousarray(hidden[rows], dtype=np.float32),
                                    np.ascontiguousarray(head[rows, columns[i - 1]], dtype=np.float32))
            acc[rows, lo:hi] = tail + running_scores[rows, None]
            hidden_tails[rows, i - 1] = False
            rt.tail_stats["tails"][i - 1] += rows.size


__all__ = ["Beam", "BeamParams", "best_first", "run_beam_search"]
