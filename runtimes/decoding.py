"""The decode loops behind `TxlRuntime.generate`: one stream, one token per step, the memory threaded through.

`sample_full` feeds each token through the main graph and samples from the full distribution; `sample_lazy`
feeds it through the adaptive softmax's head and lets the sampler ask for the tails it needs (runtimes/lazy_decode.py).
Both hold the runtime's lock for each step, never while suspended at a `yield`.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from txl_deploy.runtimes.lazy_decode import decide, full_log_probs
from txl_deploy.runtimes.sampling import Sampler


def sample_lazy(rt, ids, sampler: Sampler) -> Iterator[int]:
    """`sample_full` through the softmax's parts: each fed token computes the head, and a decision computes only
    the tails its sampler asks for (runtimes/lazy_decode.py). While suspended between tokens the runtime has
    no full distribution of the next token (`_last_log_probs` is a NaN row, which generate() without a prompt
    refuses); when the generator ends or is dropped it is assembled from the head and every tail, once."""
    pending = np.full((1, rt.n_token), np.nan, dtype=np.float32)
    last = None
    try:
        with rt._lock:
            if ids is not None:
                last = feed_head(rt, ids)
            else:
                rt._check_can_continue()
                log_probs = rt._last_log_probs[0]
        for _ in range(sampler.params.max_tokens):
            if last is None:
                tok, revealed = sampler.choose(log_probs), ()  # continuing a full distribution left by a call
            else:
                choice = decide(rt.backend, [sampler], *last).choices[0]
                tok, revealed = int(choice.token), choice.revealed
            _count_decision(rt, revealed)
            yield tok  # no lock held here
            if tok in sampler.params.stop_token_ids:
                return
            with rt._lock:  # one locked step, fed when the next token is asked for (the last one too)
                last = feed_head(rt, rt._check_tokens(np.array([[tok]], dtype=np.int64)))
                rt._last_log_probs = pending
    finally:
        with rt._lock:
            if last is not None and (rt._last_log_probs is pending or ids is not None and
                                     rt._last_log_probs is None):
                rt._last_log_probs = full_log_probs(rt.backend, *last)


def feed_head(rt, tokens: np.ndarray):
    """Feed tokens [B, Q] (checked) and return run_head's outputs at the last position: (hidden [B, d_model],
    head [B, H]). Segments before the last run the full path at their last position only."""
    B, Q = tokens.shape
    rt._ensure_state(B)
    step = rt.backend.max_segment
    starts = list(range(0, Q, step))
    rt._last_log_probs = None
    for start in starts[:-1]:
        seg = tokens[:, start:start + step]
        rt.backend.run(rt._state, seg, np.full((B, 1), seg.shape[1] - 1, dtype=np.int64))
    seg = tokens[:, starts[-1]:]
    hidden, head = rt.backend.run_head(rt._state, seg, np.full((B, 1), seg.shape[1] - 1, dtype=np.int64))
    return hidden[:, -1], head[:, -1]


def _count_decision(rt, revealed):
    stats = rt.tail_stats
    stats["decisions"] += 1
    for i in set(revealed):
        stats["tails"][i - 1] += 1


def sample_full(rt, ids, sampler: Sampler) -> Iterator[int]:
    with rt._lock:
        # Checked again: another caller may have changed the memory since generate() was called.
        if ids is not None:
            log_probs = rt.prefill(ids)[0]
        else:
            rt._check_can_continue()
            log_probs = rt._last_log_probs[0]
    for _ in range(sampler.params.max_tokens):
        tok = sampler.choose(log_probs)
        yield tok  # no lock held here
        if tok in sampler.params.stop_token_ids:
            return
        # Fed when the next token is asked for (the last one too), so the memory holds the generated text.
        log_probs = rt.prefill(np.array([[tok]], dtype=np.int64))[0]  # one locked step

