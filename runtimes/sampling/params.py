"""Sampling parameters: one validated set (`SamplingParams`) for every path that generates, checked once when built.

As vLLM's `SamplingParams`, the parameters are built once from a request, checked once (`SamplingParams(...)` raises
InputError naming the first bad value) and handed to the engine. A path that cannot honour a parameter refuses it
(`only`): nothing is ignored. What each parameter does is docs/sampling.md's list of steps.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.runtimes.arguments import is_real, whole

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



__all__ = ["SamplingParams", "generation_params", "unk_id", "TOKEN_CONTROLS", "TEXT_CONTROLS", "MAX_STOP",
           "MAX_LOGPROBS", "LOGIT_BIAS_LIMIT", "PENALTY_LIMIT"]
