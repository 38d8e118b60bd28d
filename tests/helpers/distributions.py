"""Two next-token distributions compared as the reduced-precision gates state it: the mean KL divergence of the
tested one from the reference, and how often both put the same word on top.

Both take log-probs shaped [..., V] (one distribution per position) and are computed independently of the
project's own comparisons (`exporters/onnx/verify.py`, `txl_deploy/bench/timing.py`), which tests check against
them.
"""

from __future__ import annotations

import numpy as np


def mean_kl(want, got) -> float:
    """KL(want || got) in nats, averaged over positions, in float64."""
    want, got = np.asarray(want, dtype=np.float64), np.asarray(got, dtype=np.float64)
    return float((np.exp(want) * (want - got)).sum(-1).mean())


def top1_agreement(want, got) -> float:
    """The share of positions where both distributions' most likely word is the same."""
    return float((np.asarray(want).argmax(-1) == np.asarray(got).argmax(-1)).mean())
