"""Choosing the next token: one validated set of sampling parameters (`SamplingParams`) and one sampler.

Every path that generates uses this module: `TxlRuntime.generate`, the HTTP server (`txl-deploy serve`, also over a
Triton fleet), and the Triton client (`serve-client`; the Triton model returns log-probs and the client samples).
`exporters/web/static/txl.js` implements the same steps in the same order for the browser page, the
cluster-factored algorithm for an adaptive softmax included (docs/sampling.md), and draws the same uniform numbers
from the same seeded generator, so a seeded page samples the tokens Python samples (up to the last bit of the
browser's exp and log).

As vLLM's `SamplingParams`, the parameters are built once from a request, checked once (`SamplingParams(...)` raises
InputError naming the first bad value) and handed to the engine; a `Sampler` is one stream's state (its generator,
the context the penalties look at). A path that cannot honour a parameter refuses it (`only`): nothing is ignored.

The scores every control acts on are the model's log-probabilities (the log-softmax of its logits), as in
HuggingFace's TransfoXLLMHeadModel, whose scores are log-probabilities too. The steps, in HuggingFace `generate`'s
order:

1. `logit_bias`: added to the scores of the tokens named (OpenAI).
2. `repetition_penalty` (HuggingFace, CTRL paper): the score s of every token in the context (the prompt of this
   request and the tokens generated so far) becomes s * p if s < 0, else s / p.
3. `presence_penalty`, `frequency_penalty` (OpenAI's formula): s[j] - c[j] * frequency - (c[j] > 0) * presence,
   with c[j] the number of times token j was generated so far in this request.
4. `no_repeat_ngram_size` n (HuggingFace): a token that would repeat an n-gram of the context gets -inf.
5. `min_tokens`: the stop token ids get -inf until that many tokens have been generated. `ban_unk`: the
   vocabulary's `<unk>` gets -inf, so no sampled text holds it (a word model trained on WikiText-103 predicts
   `<unk>` often: its corpus replaced every rare word by it).
6. `temperature` 0: greedy, the first maximum of these scores (nothing is drawn). Otherwise the scores / T, then
7. `top_k` (ties with the k-th score stay), `top_p` (a token stays while the probability of the more likely ones,
   ties in id order, is below p: the most likely always stays), `min_p` (a token stays if its probability is at
   least min_p times the most likely one's), each on the distribution the previous one left;
8. one uniform number u in [0, 1) from numpy's PCG64 seeded with `seed` (`np.random.default_rng(seed)`, one draw
   per sampled token): the token is the first whose running sum of weights exceeds u times their total. The weights
   are exp(score - max) of the tokens left; sums are running sums in id order (no pairwise summation), so the
   browser's loop adds in the same order.

The log-probs reported with a token (`top_logprobs`) are the model's own, before these steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import numpy as np

from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError
from txl_deploy.runtimes.arguments import is_real, whole
from txl_deploy.runtimes.tail_bounds import MASS_MARGIN, power_sum_bound

__all__ = ["Choice", "Clusters", "Sampler", "SamplingParams"]

MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_LOGPROBS = 20  # alternatives reported per token
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: a bias lies in [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI: presence and frequency penalties lie in [-2, 2]

# What each path can do, for `SamplingParams.only`: token-level controls every sampler has, and the parts of a text
# response that only a path producing text can give.
TOKEN_CONTROLS = frozenset({"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                            "frequency_penalty", "no_repeat_ngram_size", "logit_bias", "seed", "stop_token_ids",
                            "max_tokens", "min_tokens", "ban_unk"})
TEXT_CONTROLS = frozenset({"stop", "logprobs"})


def _real(name: str, value, lo: float, hi: float, lo_open: bool = False) -> float:
    if not is_real(value) or not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo):
        left = "(" if lo_open else "["
        raise InputError(f"{name} must be in {left}{lo:g}, {hi:g}], got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to choose tokens and when to stop; checked when built. Defaults change nothing (greedy is temperature 0)."""

    temperature: float = 1.0
    top_k: int | None = None  # None: every token
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    logit_bias: Mapping[int, float] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None  # report the chosen token's log-prob and this many alternatives
    ban_unk: bool = False  # never choose the vocabulary's <unk> (needs the vocabulary: see `unk_id`)

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen)
        if not is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        set_("temperature", float(self.temperature))
        if self.top_k is not None:
            set_("top_k", whole("top_k", self.top_k, lo=1))
        set_("top_p", _real("top_p", self.top_p, 0.0, 1.0, lo_open=True))
        set_("min_p", _real("min_p", self.min_p, 0.0, 1.0))
        rp = self.repetition_penalty
        if not is_real(rp) or not math.isfinite(rp) or rp <= 0:
            raise InputError(f"repetition_penalty must be a finite number > 0, got {rp!r}")
        set_("repetition_penalty", float(rp))
        set_("presence_penalty", _real("presence_penalty", self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT))
        set_("frequency_penalty", _real("frequency_penalty", self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT))
        set_("no_repeat_ngram_size", whole("no_repeat_ngram_size", self.no_repeat_ngram_size, lo=0))
        if not isinstance(self.logit_bias, Mapping):
            raise InputError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
        bias = {}
        for key, value in self.logit_bias.items():
            tok = _token_key(key)
            bias[tok] = _real(f"logit_bias[{tok}]", value, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        set_("logit_bias", bias)
        set_("seed", None if self.seed is None else whole("seed", self.seed, lo=0))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stop) > MAX_STOP:
            raise InputError(f"stop takes at most {MAX_STOP} strings, got {len(stop)}")
        if any(not isinstance(s, str) or not s for s in stop):
            raise InputError("stop strings must be non-empty strings")
        set_("stop", stop)
        ids = np.atleast_1d(np.asarray(self.stop_token_ids if self.stop_token_ids is not None else (), dtype=object))
        set_("stop_token_ids", tuple(whole("stop token id", s, lo=0) for s in ids.tolist()))
        set_("max_tokens", whole("max_tokens", self.max_tokens, lo=0))
        set_("min_tokens", whole("min_tokens", self.min_tokens, lo=0))
        if self.min_tokens > self.max_tokens:
            raise InputError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None:
            n = self.logprobs
            if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= MAX_LOGPROBS:
                raise InputError(f"logprobs must be a whole number in [0, {MAX_LOGPROBS}], got {n!r}")
            set_("logprobs", int(n))
        if not isinstance(self.ban_unk, (bool, np.bool_)):
            raise InputError(f"ban_unk must be true or false, got {self.ban_unk!r}")
        set_("ban_unk", bool(self.ban_unk))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def changed(self) -> set[str]:
        """The parameters given other values than their defaults."""
        defaults = SamplingParams()
        return {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(defaults, f.name)}

    def only(self, supported: Iterable[str], where: str):
        """Refuse (InputError) any parameter set here that `where` cannot honour."""
        extra = sorted(self.changed() - set(supported))
        if extra:
            raise InputError(f"{where} does not support {', '.join(extra)}: it produces token ids, not text "
                             "(the HTTP server does: txl-deploy serve)" if set(extra) <= TEXT_CONTROLS
                             else f"{where} does not support {', '.join(extra)}")

    def check_vocabulary(self, n_token: int):
        """Token ids named here (logit_bias, stop_token_ids) must exist in a vocabulary of n_token."""
        for what, ids in (("logit_bias", self.logit_bias), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= n_token]
            if bad:
                raise InputError(f"{what} names token id {bad[0]}, outside the vocabulary [0, {n_token})")


def unk_id(params: SamplingParams, vocab) -> int | None:
    """The token id `ban_unk` bans: the vocabulary's `<unk>`, or None when nothing is banned (ban_unk off, or a
    vocabulary without `<unk>`, which can never produce one). InputError when ban_unk is asked of a model without a
    vocabulary: which id is `<unk>` is then unknown, and a ban on nothing would be a request silently ignored."""
    if not params.ban_unk:
        return None
    if vocab is None:
        raise InputError("ban_unk needs the model's vocabulary, to know which token is <unk>; this model has none "
                         "(ban the id with logit_bias ID=-100 instead)")
    return None if vocab.unk is None else vocab.index[vocab.unk]


def _token_key(key) -> int:
    """A logit_bias key: a token id, also as a JSON object key (a string of digits)."""
    if isinstance(key, str) and key.strip().isdigit():
        key = int(key)
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)) or key < 0:
        raise InputError(f"logit_bias keys must be token ids (whole numbers >= 0), got {key!r}")
    return int(key)


# -- the steps, each a pure function (the tests hold each against its HuggingFace or OpenAI definition) ------------
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


def _positions(ids: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the sorted `targets` occur in the sorted `ids`: (positions in ids, positions in targets)."""
    pos = np.searchsorted(ids, targets)
    inside = np.flatnonzero(pos < ids.size)
    hit = inside[ids[pos[inside]] == targets[inside]]
    return pos[hit], hit


def _top_known(ids: np.ndarray, lps: np.ndarray, n: int) -> list[tuple[int, float]]:
    """top_logprobs over the tokens known (ids with their log-probs): most likely first, ties in id order."""
    if n <= 0:
        return []
    order = np.lexsort((ids, -lps.astype(np.float64)))[:n]
    return [(int(ids[j]), float(lps[j])) for j in order]


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
    softmax's layout (`Clusters.of(config)`); with it every decision is the cluster-factored one (docs/sampling.md),
    which `start` runs on the head alone, asking for a tail only when the decision can depend on it, and `choose`
    and `choose_parts` run with every tail at hand. `tail_counts[i - 1]` counts the decisions that needed tail
    cluster i, out of `decisions`."""

    def __init__(self, params: SamplingParams, n_token: int, context=(), vocab=None, clusters: Clusters | None = None):
        params.check_vocabulary(n_token)
        if clusters is not None and clusters.n_token != n_token:
            raise InputError(f"the clusters cover {clusters.n_token} tokens, the vocabulary {n_token}")
        self.unk = unk_id(params, vocab)
        self.params, self.n_token, self.clusters = params, n_token, clusters
        self.rng = np.random.default_rng(params.seed)
        self.context = [int(t) for t in np.asarray(context, dtype=np.int64).reshape(-1)]
        self.generated: list[int] = []
        self.counts = np.zeros(n_token, dtype=np.int64)
        self._plain = not (params.logit_bias or params.repetition_penalty != 1 or params.presence_penalty
                           or params.frequency_penalty or params.no_repeat_ngram_size or
                           (params.min_tokens and params.stop_token_ids) or self.unk is not None)
        self.decisions = 0
        self.tail_counts = np.zeros(0 if clusters is None else clusters.n_clusters, dtype=np.int64)

    def scores(self, log_probs: np.ndarray) -> np.ndarray:
        """Steps 1-5 on one distribution [V]: the scores that temperature and the filters act on (float64)."""
        p = self.params
        s = np.array(log_probs, dtype=np.float64).reshape(-1)
        if s.size != self.n_token:
            raise InputError(f"log-probs have {s.size} entries, the vocabulary {self.n_token}")
        if self._plain:
            return s
        if p.logit_bias:
            ids = np.fromiter(p.logit_bias, dtype=np.int64)
            s[ids] += np.fromiter(p.logit_bias.values(), dtype=np.float64)
        if p.repetition_penalty != 1:
            s = repetition_penalty(s, self.context + self.generated, p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            s = openai_penalties(s, self.counts, p.presence_penalty, p.frequency_penalty)
        if p.no_repeat_ngram_size:
            s[banned_ngram_tokens(self.context + self.generated, p.no_repeat_ngram_size)] = -np.inf
        if p.min_tokens and len(self.generated) < p.min_tokens and p.stop_token_ids:
            s[list(p.stop_token_ids)] = -np.inf
        if self.unk is not None:
            s[self.unk] = -np.inf
        return s

    # -- the whole distribution at hand ---------------------------------------------------------------------------
    def choose(self, log_probs: np.ndarray) -> int:
        """The next token for these log-probs [V]; it becomes part of the stream's history. With clusters: the
        cluster-factored decision on the head `head_from_full` derives and the tails sliced from the same row."""
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
        head = np.asarray(head_log_probs).reshape(-1)
        if head.size != self.clusters.head_size:
            raise InputError(f"head log-probs have {head.size} entries, the head {self.clusters.shortlist} "
                             f"shortlist tokens and {self.clusters.n_clusters} clusters")
        return Choice(self, steps=self._factored(head))

    def _choose_full(self, log_probs, commit=True) -> int:
        p = self.params
        if self._plain and p.greedy:  # the common case, without the float64 copy
            tok = int(np.argmax(log_probs))
        else:
            s = self.scores(log_probs)
            if not np.isfinite(s.max()):
                raise InputError("no token is left to choose: the sampling parameters exclude every token")
            if p.greedy:
                tok = int(np.argmax(s))
            else:
                tok = draw(filtered_weights(s, p.temperature, p.top_k, p.top_p, p.min_p), self.rng.random())
        if commit:
            self._commit(tok, ())
        return tok

    def _commit(self, tok: int, revealed: tuple[int, ...]):
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

    # -- steps 1-5 token by token ---------------------------------------------------------------------------------
    def _adjustments(self):
        """This decision's steps 1-5 as the sorted token ids each touches: (bias ids, bias values, repetition
        ids, banned ids), and every token any step touches."""
        p = self.params
        bias_ids = np.array(sorted(p.logit_bias), dtype=np.int64)
        bias_vals = np.array([p.logit_bias[t] for t in bias_ids.tolist()], dtype=np.float64)
        rep = np.unique(np.asarray(self.context + self.generated, dtype=np.int64)) if p.repetition_penalty != 1 \
            else np.zeros(0, np.int64)
        banned = []
        if p.no_repeat_ngram_size:
            banned += banned_ngram_tokens(self.context + self.generated, p.no_repeat_ngram_size)
        if p.min_tokens and len(self.generated) < p.min_tokens:
            banned += list(p.stop_token_ids)
        if self.unk is not None:
            banned.append(self.unk)
        banned = np.unique(np.asarray(banned, dtype=np.int64))
        counted = np.flatnonzero(self.counts) if p.presence_penalty or p.frequency_penalty else np.zeros(0, np.int64)
        touched = np.unique(np.concatenate([bias_ids, rep, banned, counted]))
        return (bias_ids, bias_vals, rep, banned), touched

    def _steps(self, ids: np.ndarray, values, adj) -> np.ndarray:
        """Steps 1-5 on the tokens `ids` (sorted) with these log-probs: what `scores` gives them (the same
        float64 operations, element by element)."""
        p = self.params
        s = np.array(values, dtype=np.float64).reshape(-1)
        if self._plain:
            return s
        bias_ids, bias_vals, rep, banned = adj
        at, which = _positions(ids, bias_ids)
        s[at] += bias_vals[which]
        if rep.size:
            at, _ = _positions(ids, rep)
            v = s[at]
            s[at] = np.where(v < 0, v * p.repetition_penalty, v / p.repetition_penalty)
        if p.presence_penalty or p.frequency_penalty:
            s = openai_penalties(s, self.counts[ids], p.presence_penalty, p.frequency_penalty)
        at, _ = _positions(ids, banned)
        s[at] = -np.inf
        return s

    # -- the cluster-factored decision ----------------------------------------------------------------------------
    def _factored(self, head: np.ndarray):
        """The one decision algorithm for adaptive models (docs/sampling.md): a generator that yields the tail
        clusters it needs next, is sent {i: tail log-probs}, and returns (token, log-prob, top log-probs)."""
        p, c = self.params, self.clusters
        adj, touched = self._adjustments()
        n_short = c.shortlist
        # the known tokens: part 0 the shortlist, part i tail cluster i once revealed
        ids = {0: np.arange(n_short)}
        raw = {0: head[:n_short]}
        proc = {0: self._steps(ids[0], raw[0], adj)}
        hcol = np.array([float(head[c.head_column(i)]) for i in range(1, c.n_clusters + 1)])
        bound = np.empty(c.n_clusters)  # B_i: every processed score of cluster i is <= it
        adj_bounds = []  # f_t(head_i) of the touched tokens of cluster i
        for i, (lo, hi) in enumerate(c.bounds, start=1):
            t = touched[(touched >= lo) & (touched < hi)]
            fb = self._steps(t, np.full(t.size, hcol[i - 1]), adj)
            adj_bounds.append(fb)
            bound[i - 1] = max(hcol[i - 1], float(fb.max())) if fb.size else hcol[i - 1]

        def reveal(needed):
            given = yield tuple(needed)
            for i in needed:
                lo, hi = c.bounds[i - 1]
                ids[i] = np.arange(lo, hi)
                raw[i] = given[i]
                proc[i] = self._steps(ids[i], given[i], adj)

        def hidden():
            return [i for i in range(1, c.n_clusters + 1) if i not in ids]

        def known(what):
            parts = sorted(what)
            return np.concatenate([ids[k] for k in parts]), np.concatenate([what[k] for k in parts])

        if p.greedy:
            tok = yield from self._greedy(proc, ids, bound, hidden, reveal)
        else:
            tok = yield from self._sample(proc, ids, bound, hcol, adj_bounds, hidden, reveal)
        top = []
        n = p.logprobs or 0
        if n:  # a hidden cluster's tokens are all <= its head log-prob: it matters only if that reaches the n-th
            _, k_lp = known(raw)
            nth = -np.inf if k_lp.size < n else -float(np.partition(-k_lp.astype(np.float64), n - 1)[n - 1])
            need = [i for i in hidden() if hcol[i - 1] >= nth]
            if need:
                yield from reveal(need)
            top = _top_known(*known(raw), n)
        part = 0 if tok < n_short else next(i for i in ids if i and ids[i][0] <= tok < ids[i][-1] + 1)
        return tok, float(raw[part][tok - ids[part][0]]), top

    def _greedy(self, proc, ids, bound, hidden, reveal):
        """The first maximum: a hidden cluster can hold it only if its bound beats the best known score, or
        equals it with lower ids than the best known token's."""
        c = self.clusters
        while True:
            best, best_id = -np.inf, -1
            for k in sorted(proc):
                j = int(np.argmax(proc[k]))
                if proc[k][j] > best:
                    best, best_id = float(proc[k][j]), int(ids[k][j])
            can = [i for i in hidden() if bound[i - 1] > best or
                   (bound[i - 1] == best and best > -np.inf and c.bounds[i - 1][0] < best_id)]
            if not can:
                break
            yield from reveal([max(can, key=lambda i: (bound[i - 1], -i))])
        if best_id < 0:
            raise InputError("no token is left to choose: the sampling parameters exclude every token")
        return best_id

    def _sample(self, proc, ids, bound, hcol, adj_bounds, hidden, reveal):
        """Temperature, top-k, top-p, min-p and the draw, by rejection over blocks (shortlist tokens, then clusters
        in id order), a hidden cluster's block an upper bound of its mass."""
        p, c, T = self.params, self.clusters, self.params.temperature
        x = {}  # processed score / T of the known tokens

        def scaled():
            for k in proc:
                if k not in x:
                    x[k] = proc[k] / T

        def known_x():
            parts = sorted(x)
            return np.concatenate([x[k] for k in parts])

        scaled()
        xb = bound / T
        # the shift m: from the head alone, >= every scaled score (so no weight overflows)
        m = max(float(np.max(x[0])) if x[0].size else -np.inf, float(np.max(xb)))
        if not m > -np.inf:
            raise InputError("no token is left to choose: the sampling parameters exclude every token")
        dead = set()  # hidden clusters whose every token is filtered out
        kth = -np.inf
        if p.top_k is not None and p.top_k < self.n_token:
            # the k-th largest known score is <= the true k-th; a hidden cluster below it holds none of the top k
            while True:
                kx = known_x()
                kth = -np.inf if kx.size < p.top_k else float(np.partition(kx, kx.size - p.top_k)[kx.size - p.top_k])
                can = [i for i in hidden() if xb[i - 1] >= kth]
                if not can:
                    break
                yield from reveal([max(can, key=lambda i: (xb[i - 1], -i))])
                scaled()
            dead.update(hidden())

        def weights(k):
            s = x[k] if kth == -np.inf else np.where(x[k] < kth, -np.inf, x[k])  # (no top-k: nothing to cut)
            return np.exp(s - m)

        # per hidden cluster: the largest weight b_i one token can have, and the mass bound W_i
        tb = np.exp(xb - m)
        mass = np.array([(1 + MASS_MARGIN) * (math.exp(hcol[i] / T - m) * power_sum_bound(hi - lo, T) +
                                              float(np.sum(np.exp(adj_bounds[i] / T - m))))
                         for i, (lo, hi) in enumerate(c.bounds)])
        cut = {}  # part -> bool mask of its tokens top-p cuts
        if p.top_p < 1:
            while True:
                live = [i for i in hidden() if i not in dead]
                parts = sorted(x)
                w = np.concatenate([weights(k) for k in parts])
                kid = np.concatenate([ids[k] for k in parts])
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
                yield from reveal([max(live, key=lambda i: (mass[i - 1], -i))])
                scaled()
            dead.update(live)
            mask = np.zeros(w.size, dtype=bool)
            mask[order] = gone
            start = 0
            for k in parts:
                cut[k] = mask[start:start + ids[k].size]
                start += ids[k].size
        floor = 0.0
        if p.min_p > 0:
            # the cut is min_p times the largest weight: exact once no hidden cluster can beat the known maximum
            while True:
                top = float(np.max(known_x()))
                can = [i for i in hidden() if i not in dead and xb[i - 1] > top]
                if not can:
                    break
                yield from reveal([max(can, key=lambda i: (xb[i - 1], -i))])
                scaled()
            floor = p.min_p * math.exp(top - m)  # top-k and top-p keep the most likely token
            dead.update(i for i in hidden() if tb[i - 1] < floor)

        def final(k):
            w = weights(k)
            if k in cut:
                w = np.where(cut[k], 0.0, w)
            return np.where(w < floor, 0.0, w) if floor > 0 else w  # (weights are >= 0: a 0 floor cuts nothing)

        while True:
            blocks = [final(k) if k in proc else np.array([0.0 if k in dead else mass[k - 1]])
                      for k in range(c.n_clusters + 1)]
            lens = [b.size for b in blocks]
            flat = np.concatenate(blocks)
            cum = np.cumsum(flat)
            if not cum[-1] > 0:
                raise InputError("no token is left to choose: the sampling parameters exclude every token")
            at = int(np.searchsorted(cum, self.rng.random() * cum[-1], side="right"))
            if at >= flat.size or not flat[at] > 0:  # a rounding past the end: the last block with mass
                at = min(at, int(np.flatnonzero(flat > 0)[-1]))
            k, start = 0, 0
            while at >= start + lens[k]:
                start += lens[k]
                k += 1
            if k in proc:
                return int(ids[k][at - start])
            # a hidden cluster's block: reveal it, accept with probability S_i / W_i, then draw inside it
            yield from reveal([k])
            scaled()
            w = final(k)
            inner = float(np.cumsum(w)[-1])
            if self.rng.random() * mass[k - 1] < inner:
                return int(ids[k][0]) + draw(w, self.rng.random())


def generation_params(where: str, params, given: dict, defaults: dict, controls: dict) -> SamplingParams:
    """The SamplingParams of a token generator with the classic arguments (`given`: max_new_tokens, temperature,
    top_k, top_p (None: 1), seed, stop (token ids)), the other controls by name, or one `params`; never both.
    Refuses what a token generator cannot do (stop strings, log-probs)."""
    if params is None:
        kw = dict(given, **controls)
        kw["max_tokens"] = kw.pop("max_new_tokens")
        stop = kw.pop("stop")
        kw["stop_token_ids"] = () if stop is None else stop
        kw["top_p"] = 1.0 if kw["top_p"] is None else kw["top_p"]
        try:
            params = SamplingParams(**kw)
        except TypeError as e:  # an unknown keyword
            raise InputError(f"{where}: {e}") from None
    elif not isinstance(params, SamplingParams):
        raise InputError(f"params must be a SamplingParams, got {type(params).__name__}")
    elif controls or given != defaults:
        raise InputError(f"{where} takes the sampling parameters either as params=SamplingParams(...) or as keyword "
                         "arguments, not both")
    params.only(TOKEN_CONTROLS, where)
    return params


def sample(log_probs: np.ndarray, params: SamplingParams, rng: np.random.Generator | None = None) -> int:
    """One token from one distribution with no history (no penalties apply): steps 1, 6-8. `rng` defaults to one
    seeded with params.seed."""
    sampler = Sampler(params, np.asarray(log_probs).size)
    if rng is not None:
        sampler.rng = rng
    return sampler.choose(log_probs)
