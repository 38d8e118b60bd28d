"""Running a stream of segments through a runtime."""

from __future__ import annotations

import numpy as np


def stream(rt, segments):
    """The log-probs of every position of `segments` fed one after another from an empty memory, [B, sum(Q), V];
    the runtime is reset before and after."""
    rt.reset()
    out = np.concatenate([rt.step(s) for s in segments], axis=1)
    rt.reset()
    return out
