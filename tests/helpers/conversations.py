"""What a served conversation is compared with: the same conversation alone in an in-process TxlRuntime."""

from __future__ import annotations

import numpy as np


def alone(make_rt, prompt, n):
    """Greedy tokens and the log-probs behind each, for one conversation alone in an in-process TxlRuntime."""
    rt = make_rt()
    lp = rt.prefill(np.asarray(prompt, dtype=np.int64)[None])[0]
    toks, lps = [], []
    for _ in range(n):
        lps.append(lp)
        toks.append(int(np.argmax(lp)))
        lp = rt.prefill(np.array([[toks[-1]]]))[0]
    return toks, lps
