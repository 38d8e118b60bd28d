"""The score processors (steps 1-5 of docs/sampling.md): logit bias, repetition penalty, OpenAI's presence and
frequency penalties, n-gram bans, min_tokens and ban_unk, and a constraint's mask, on a whole row or token by token.

Each step is a pure function the tests hold against its HuggingFace or OpenAI definition; `Processors` applies them
for one decision, given the stream's history, either to a full row (`full`) or to some tokens only (`on`, what the
cluster-factored decision needs), with the same float64 operations element by element.
"""

from __future__ import annotations

import numpy as np

from txl_deploy.runtimes.sampling.params import SamplingParams


def repetition_penalty(scores: np.ndarray, context, penalty: float) -> np.ndarray:
    """HuggingFace's RepetitionPenaltyLogitsProcessor: tokens of the context get s * p (s < 0) or s / p."""
    out = np.array(scores, dtype=np.float64)
    seen = np.unique(np.asarray(context, dtype=np.int64))
    if penalty != 1 and seen.size:
        s = out[seen]
        out[seen] = np.where(s < 0, s * penalty, s / penalty)
    return out


def openai_penalties(scores: np.ndarray, counts: np.ndarray, presence: float, frequency: float) -> np.ndarray:
    """OpenAI's formula: mu[j] - c[j] * frequency_penalty - float(c[j] > 0) * presence_penalty."""
    return np.asarray(scores, dtype=np.float64) - counts * frequency - (counts > 0) * presence


def banned_ngram_tokens(ids, n: int) -> list[int]:
    """HuggingFace's NoRepeatNGramLogitsProcessor: the tokens that would complete an n-gram already in `ids`."""
    ids = [int(i) for i in ids]
    if n < 1 or len(ids) + 1 < n:
        return []
    prefix = tuple(ids[len(ids) - n + 1:]) if n > 1 else ()
    return sorted({ids[i + n - 1] for i in range(len(ids) - n + 1) if tuple(ids[i:i + n - 1]) == prefix})


def changes_nothing(params: SamplingParams, unk: int | None) -> bool:
    """True when no step 1-5 can change a score: the scores are the model's log-probs."""
    return not (params.logit_bias or params.repetition_penalty != 1 or params.presence_penalty
                or params.frequency_penalty or params.no_repeat_ngram_size
                or (params.min_tokens and params.stop_token_ids) or unk is not None)


def positions(ids: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the sorted `targets` occur in the sorted `ids`: (positions in ids, positions in targets)."""
    pos = np.searchsorted(ids, targets)
    inside = np.flatnonzero(pos < ids.size)
    hit = inside[ids[pos[inside]] == targets[inside]]
    return pos[hit], hit


class Processors:
    """Steps 1-5 for one decision of a stream: `context` the token ids it was given and `generated` those it
    generated (the repetition penalty and n-gram bans see both), `counts[j]` how often it generated token j, `unk`
    the banned `<unk>` id (None: none), `allowed` a constraint's mask [V] (None: every token; the others get -inf
    last). `plain`: no step changes anything."""

    def __init__(self, params: SamplingParams, context: list[int], generated: list[int], counts: np.ndarray,
                 unk: int | None, allowed: np.ndarray | None = None):
        self.params, self.context, self.generated, self.counts, self.unk = params, context, generated, counts, unk
        self.allowed = allowed
        self.n_generated = len(generated)
        self.plain = changes_nothing(params, unk) and allowed is None
        self._touched = None

    @property
    def history(self) -> list[int]:
        return self.context + self.generated

    def full(self, log_probs: np.ndarray) -> np.ndarray:
        """Steps 1-5 on a whole row [V] (float64)."""
        p = self.params
        s = np.array(log_probs, dtype=np.float64).reshape(-1)
        if self.plain:
            return s
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias, dtype=np.int64)
            s[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64)
        if p.repetition_penalty != 1:
            s = repetition_penalty(s, self.history, p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            s = openai_penalties(s, self.counts, p.presence_penalty, p.frequency_penalty)
        if p.no_repeat_ngram_size:
            s[banned_ngram_tokens(self.history, p.no_repeat_ngram_size)] = -np.inf
        if p.min_tokens and self.n_generated < p.min_tokens and p.stop_token_ids:
            s[list(p.stop_token_ids)] = -np.inf
        if self.unk is not None:
            s[self.unk] = -np.inf
        if self.allowed is not None:
            s[~self.allowed] = -np.inf
        return s

    def _by_token(self):
        """The sorted ids each step touches: (bias ids, bias values, repetition ids, banned ids), and every token
        any step touches."""
        if self._touched is None:
            p = self.params
            bias_ids = np.array(sorted(p.logit_bias), dtype=np.int64)
            bias_vals = np.array([p.logit_bias[t] for t in bias_ids.tolist()], dtype=np.float64)
            rep = np.unique(np.asarray(self.history, dtype=np.int64)) if p.repetition_penalty != 1 \
                else np.zeros(0, np.int64)
            banned = []
            if p.no_repeat_ngram_size:
                banned += banned_ngram_tokens(self.history, p.no_repeat_ngram_size)
            if p.min_tokens and self.n_generated < p.min_tokens:
                banned += list(p.stop_token_ids)
            if self.unk is not None:
                banned.append(self.unk)
            banned = np.unique(np.asarray(banned, dtype=np.int64))
            counted = np.flatnonzero(self.counts) if p.presence_penalty or p.frequency_penalty \
                else np.zeros(0, np.int64)
            touched = np.unique(np.concatenate([bias_ids, rep, banned, counted]))
            self._touched = (bias_ids, bias_vals, rep, banned), touched
        return self._touched

    @property
    def touched(self) -> np.ndarray:
        """Every token id some step changes (sorted)."""
        return self._by_token()[1]

    def on(self, ids: np.ndarray, values) -> np.ndarray:
        """Steps 1-5 on the tokens `ids` (sorted) with these log-probs: what `full` gives them (the same float64
        operations, element by element)."""
        p = self.params
        s = np.array(values, dtype=np.float64).reshape(-1)
        if self.plain:
            return s
        (bias_ids, bias_vals, rep, banned), _ = self._by_token()
        at, which = positions(ids, bias_ids)
        s[at] += bias_vals[which]
        if rep.size:
            at, _ = positions(ids, rep)
            v = s[at]
            s[at] = np.where(v < 0, v * p.repetition_penalty, v / p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            s = openai_penalties(s, self.counts[ids], p.presence_penalty, p.frequency_penalty)
        at, _ = positions(ids, banned)
        s[at] = -np.inf
        if self.allowed is not None:
            s[~self.allowed[ids]] = -np.inf
        return s


__all__ = ["repetition_penalty", "openai_penalties", "banned_ngram_tokens", "changes_nothing", "Processors"]
