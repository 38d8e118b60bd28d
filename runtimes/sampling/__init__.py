"""Choosing the next token: one validated set of sampling parameters (`SamplingParams`) and one sampler per stream.

Every path that generates uses it: `TxlRuntime.generate`, the HTTP server and the Triton client; the browser page's
txl.js runs the same steps in the same order with the same seeded draws. The scores every control acts on are the
model's log-probabilities, processed in HuggingFace `generate`'s order, then temperature, the filters and one
seeded uniform per draw. docs/sampling.md lists the steps and proves the cluster-factored decision of an adaptive
softmax exact; each module here is one of its parts:

- `params`: the parameters and their checks;
- `processors`: steps 1-5 (bias, penalties, bans), on a whole row or token by token;
- `full_row`: steps 6-8 on a whole distribution (filters, the inverse-CDF draw, top log-probs);
- `bounds` and `factored`: the cluster-factored decision, which computes a tail only when it can matter;
- `sampler`: one stream's `Sampler`, which runs one or the other.
"""

from txl_deploy.contract.clusters import Clusters
from txl_deploy.runtimes.sampling.full_row import draw, filtered_weights, top_logprobs
from txl_deploy.runtimes.sampling.params import (
    LOGIT_BIAS_LIMIT,
    MAX_LOGPROBS,
    MAX_STOP,
    PENALTY_LIMIT,
    TEXT_CONTROLS,
    TOKEN_CONTROLS,
    SamplingParams,
    generation_params,
    unk_id,
)
from txl_deploy.runtimes.sampling.processors import banned_ngram_tokens, openai_penalties, repetition_penalty
from txl_deploy.runtimes.sampling.sampler import Choice, Sampler, sample

__all__ = ["Choice", "Clusters", "Sampler", "SamplingParams", "sample", "generation_params", "unk_id",
           "filtered_weights", "draw", "top_logprobs", "repetition_penalty", "openai_penalties",
           "banned_ngram_tokens", "TOKEN_CONTROLS", "TEXT_CONTROLS", "MAX_STOP", "MAX_LOGPROBS", "LOGIT_BIAS_LIMIT",
           "PENALTY_LIMIT"]
