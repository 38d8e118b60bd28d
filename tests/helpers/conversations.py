"""What a served conversation is compared with: the same conversation alone in an in-process TxlRuntime."""

from __future__ import annotations

import numpy as np


def greedy_segments(rt, segments, lp=None):
    """Feed one conversation to `rt`: each (prompt, n) feeds the prompt if any (token ids, or text the runtime's
    vocabulary encodes; prefill splits it into max_segment pieces), then n greedy tokens, each fed too. Returns, per
    segment, the tokens and the log-probs [V] each was chosen from, and the log-probs after the last token fed."""
    out = []
    for prompt, n in segments:
        if isinstance(prompt, str):
            prompt = rt.encode(prompt)
        if len(prompt):
            lp = rt.prefill(np.asarray(prompt, dtype=np.int64)[None])[0]
        toks, lps = [], []
        for _ in range(n):
            lps.append(lp)
            toks.append(int(np.argmax(lp)))
            lp = rt.prefill(np.array([[toks[-1]]]))[0]
        out.append((toks, lps))
    return out, lp


def alone(make_rt, prompt, n):
    """Greedy tokens and the log-probs behind each, for one conversation (token ids or text) alone in an in-process
    TxlRuntime."""
    rt = make_rt()
    (result,), _ = greedy_segments(rt, [(prompt, n)])
    rt.close()
    return result
