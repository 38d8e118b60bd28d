"""One stream's sampler: its seeded generator and history, and the two ways it decides a token (docs/sampling.md).

A plain softmax, or a `Sampler` built without clusters, decides on the full row (`full_row`). With an adaptive
softmax's layout every decision is the cluster-factored one (`factored`), run on the head with tails revealed as it
asks (`start`), or with every tail at hand (`choose_parts`, `choose`).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError
from txl_deploy.runtimes.sampling.factored import NO_TOKEN_LEFT, FactoredDecision
from txl_deploy.runtimes.sampling.full_row import draw, filtered_weights, top_logprobs
from txl_deploy.runtimes.sampling.params import SamplingParams, unk_id
from txl_deploy.runtimes.sampling.processors import Processors, changes_nothing


class Choice:
    """One row's decision in progress. `needs`: the tail clusters it must see before it can go on (() once
    decided); `reveal(i, tail_log_probs)` gives one. Once decided: `token`, its model log-prob `logprob`, the
    `top_logprobs` (params.logprobs of them) and `revealed`, every cluster it asked for."""

    def __init__(self, sampler: Sampler, steps=None, decided=None):
        self._sampler, self._steps, self._given = sampler, steps, {}
        self.needs: tuple[int, ...] = ()
        self.revealed: tuple[int, ...] = ()
        self.token = self.logprob = self.top_logprobs = None
        if decided is not None:
            self._finish(*decided)
        else:
            self._advance(None)

    def reveal(self, i: int, tail_log_probs) -> None:
        if i not in self.needs:
            raise InputError(f"tail cluster {i} was not asked for (this decision needs {list(self.needs)})")
        lo, hi = self._sampler.clusters.bounds[i - 1]
        tail = np.asarray(tail_log_probs).reshape(-1)
        if tail.size != hi - lo:
            raise InputError(f"tail cluster {i} has {hi - lo} tokens, got {tail.size} log-probs")
        self._given[i] = tail
        if all(j in self._given for j in self.needs):
            given, self._given = self._given, {}
            self.revealed += tuple(j for j in self.needs)
            self._advance(given)

    def _advance(self, given):
        try:
            self.needs = tuple(self._steps.send(given))
        except StopIteration as done:
            self.needs = ()
            self._finish(*done.value)

    def _finish(self, token, logprob, top):
        self.token, self.logprob, self.top_logprobs = token, logprob, top
        self._sampler._commit(token, self.revealed)


class Sampler:
    """One stream's sampling: its generator (seeded), the context the penalties see, the tokens it generated.

    `context`: the token ids the stream was given (the prompt of this request); the repetition penalty and the
    n-gram bans look at them and at the generated tokens, the presence and frequency penalties at the generated
    tokens only. `vocab`: the model's vocabulary (`ban_unk` needs it, to find `<unk>`). `clusters`: the adaptive
    softmax's layout (`Clusters.of(config)`); with it every decision is the cluster-factored one, which `start`
    runs on the head alone, asking for a tail only when the decision can depend on it, and `choose` and
    `choose_parts` run with every tail at hand. `tail_counts[i - 1]` counts the decisions that needed tail
    cluster i, out of `decisions`.

    `constraint`: the tokens each decision may choose (the mask hook; a music grammar's `GrammarState` is one),
    an object with `allowed()` (a boolean mask [V], or None for every token) and `advance(token)` (called with
    each token chosen). The tokens it leaves out get -inf after steps 1-5, before temperature and the filters, on
    the full row and in the cluster-factored decision alike (docs/sampling.md). Without one, nothing changes."""

    def __init__(self, params: SamplingParams, n_token: int, context=(), vocab=None, clusters: Clusters | None = None,
                 constraint=None):
        params.check_vocabulary(n_token)
        if clusters is not None and clusters.n_token != n_token:
            raise InputError(f"the clusters cover {clusters.n_token} tokens, the vocabulary {n_token}")
        self.unk = unk_id(params, vocab)
        self.params, self.n_token, self.clusters = params, n_token, clusters
        self.rng = np.random.default_rng(params.seed)
        self.context = [int(t) for t in np.asarray(context, dtype=np.int64).reshape(-1)]
        self.generated: list[int] = []
        self.counts = np.zeros(n_token, dtype=np.int64)
        self.constraint = constraint
        self._plain = changes_nothing(params, self.unk) and constraint is None
        self.decisions = 0
        self.tail_counts = np.zeros(0 if clusters is None else clusters.n_clusters, dtype=np.int64)

    def _processors(self) -> Processors:
        """Steps 1-5 as this decision's history makes them, with the constraint's mask."""
        return Processors(self.params, self.context, self.generated, self.counts, self.unk, self._allowed())

    def _allowed(self) -> np.ndarray | None:
        if self.constraint is None:
            return None
        mask = self.constraint.allowed()
        if mask is None:
            return None
        mask = np.asarray(mask)
        if mask.dtype != np.bool_ or mask.shape != (self.n_token,):
            raise InputError(f"a constraint's mask must be booleans [{self.n_token}], got {mask.dtype} "
                             f"{list(mask.shape)}")
        if not mask.any():
            raise InputError(f"{NO_TOKEN_LEFT} (the constraint allows none)")
        return mask

    def scores(self, log_probs: np.ndarray) -> np.ndarray:
        """Steps 1-5 on one distribution [V]: the scores that temperature and the filters act on (float64)."""
        s = np.asarray(log_probs).reshape(-1)
        if s.size != self.n_token:
            raise InputError(f"log-probs have {s.size} entries, the vocabulary {self.n_token}")
        return self._processors().full(s)

    # -- the whole distribution at hand ---------------------------------------------------------------------------
    def choose(self, log_probs: np.ndarray) -> int:
        """The next token for these log-probs [V]; it becomes part of the stream's history. With clusters: the
        cluster-factored decision on the head `head_from_full` derives (float32, as the head graph gives it) and
        the tails sliced from the same row."""
        if self.clusters is not None:
            lp = np.asarray(log_probs).reshape(-1)
            head = self.clusters.head_from_full(lp)
            return self.choose_parts(head, [lp[lo:hi] for lo, hi in self.clusters.bounds])
        return self._choose_full(log_probs)

    def choose_parts(self, head_log_probs, tails) -> int:
        """The cluster-factored decision with every tail given (tails[i - 1], or a mapping i -> tail, each the full
        log-probs of cluster i's tokens): the algorithm `start` runs, answered at once, so the same token."""
        choice = self.start(head_log_probs)
        while choice.needs:
            for i in choice.needs:
                choice.reveal(i, tails[i] if isinstance(tails, Mapping) else tails[i - 1])
        return choice.token

    def start(self, head_log_probs) -> Choice:
        """Begin a decision on the head [shortlist + n] (without clusters: the full distribution [V], decided at
        once). Drive the Choice with `reveal` while it `needs` tails; its token then joins the history."""
        if self.clusters is None:
            lp = np.asarray(head_log_probs).reshape(-1)
            tok = self._choose_full(lp, commit=False)
            n = self.params.logprobs or 0
            return Choice(self, decided=(tok, float(lp[tok]), top_logprobs(lp, n)))
        decision = FactoredDecision(self.params, self.clusters, self._processors(), head_log_probs, self.rng)
        return Choice(self, steps=decision.run())

    def _choose_full(self, log_probs, commit=True) -> int:
        p = self.params
        if self._plain and p.greedy:  # the common case, without the float64 copy
            tok = int(np.argmax(log_probs))
        else:
            s = self.scores(log_probs)
            if not np.isfinite(s.max()):
                raise InputError(NO_TOKEN_LEFT)
            if p.greedy:
                tok = int(np.argmax(s))
            else:
                tok = draw(filtered_weights(s, p.temperature, p.top_k, p.top_p, p.min_p), self.rng.random())
        if commit:
            self._commit(tok, ())
        return tok

    def _commit(self, tok: int, revealed: tuple[int, ...]):
        if self.constraint is not None:
            self.constraint.advance(tok)
        self.generated.append(tok)
        self.counts[tok] += 1
        self.decisions += 1
        for i in set(revealed):
            self.tail_counts[i - 1] += 1

    def stopped_by_token(self, token: int) -> bool:
        return token in self.params.stop_token_ids

    def tail_fractions(self) -> np.ndarray:
        """Per tail cluster, the fraction of decisions that needed it."""
        return self.tail_counts / max(self.decisions, 1)


def sample(log_probs: np.ndarray, params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """One token from one distribution with no history (no penalties apply): steps 1, 6-8. `rng` defaults to one
    seeded with params.seed."""
    sampler = Sampler(params, np.asarray(log_probs).size)
    if rng is not None:
        sampler.rng = rng
    return sampler.choose(log_probs)


__all__ = ["Choice", "Sampler", "sample"]
