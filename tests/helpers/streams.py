"""Feeding streams through a runtime, and comparing the states it saves."""

from __future__ import annotations

import numpy as np


def stream(rt, segments):
    """The log-probs of every position of `segments` fed one after another from an empty memory, [B, sum(Q), V];
    the runtime is reset before and after."""
    rt.reset()
    out = np.concatenate([rt.step(s) for s in segments], axis=1)
    rt.reset()
    return out


def one_pass(rt, tokens):
    """The log-probs of `tokens` [B, T] fed as one segment from an empty memory (reset before and after)."""
    rt.reset()
    out = rt.step(tokens)
    rt.reset()
    return out


def split_pass(rt, tokens, cuts):
    """The same, fed in segments cut at the positions `cuts`."""
    rt.reset()
    bounds = [0] + sorted(cuts) + [tokens.shape[1]]
    out = np.concatenate([rt.step(tokens[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:]) if b > a], axis=1)
    rt.reset()
    return out


def assert_state_equal(a, b):
    """Two saved states (`save_state()` dicts) hold the same arrays."""
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def assert_reset_rows_restarts_only_those_rows(rt, seed: int, atol: float):
    """After `reset(rows=[1])` on a batch of two, row 0 continues from its memory and row 1 as from an empty one:
    each compared with the same row fed alone (the runtime is reset before and after)."""
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, rt.n_token, (2, 20)), rng.integers(0, rt.n_token, (2, 6))
    rt.reset()
    rt.step(a)
    rt.reset(rows=[1])
    got = rt.step(b)
    rt.reset()
    rt.step(a[:1])
    np.testing.assert_allclose(got[0], rt.step(b[:1])[0], atol=atol)  # row 0 kept its memory
    rt.reset()
    np.testing.assert_allclose(got[1], rt.step(b[1:])[0], atol=atol)  # row 1 started afresh
    rt.reset()
