"""The sampler's mask hook (`Sampler(..., constraint=...)`): the tokens a constraint leaves out are never chosen, on
the full row and in the cluster-factored decision, which stays exact (its draws follow the masked full row's
distribution) and never computes a tail the mask closes; an all-allowing constraint changes no token; a mask that
leaves nothing is a one-line error. Synthetic adaptive distributions, built as the lazy-sampling tests build them.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.lazy_decisions import decide_lazily

from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, filtered_weights

LAYOUT = Clusters(30, [(30, 50), (50, 120)])
MODES = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.7, top_k=8), dict(temperature=1.3, top_p=0.8),
         dict(temperature=1.0, min_p=0.05), dict(temperature=0.9, top_k=20, repetition_penalty=1.4,
                                                  logit_bias={33: 5.0, 2: -3.0}, logprobs=3)]


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def _row(rng, clusters, tail_mass=0.4):
    """(head, tails, full) of one adaptive distribution in float32, as its graphs give them."""
    head = np.empty(clusters.head_size)
    head[:clusters.shortlist] = _log_softmax(rng.normal(0, 1.5, clusters.shortlist)) + np.log1p(-tail_mass)
    share = rng.dirichlet(np.ones(clusters.n_clusters))
    for i in range(1, clusters.n_clusters + 1):
        head[clusters.head_column(i)] = np.log(tail_mass * share[i - 1])
    head = _log_softmax(head).astype(np.float32)
    tails = [(head[clusters.head_column(i)] + _log_softmax(rng.normal(0, 2, hi - lo))).astype(np.float32)
             for i, (lo, hi) in enumerate(clusters.bounds, start=1)]
    return head, tails, np.concatenate([head[:clusters.shortlist]] + tails)


class Fixed:
    """A constraint with one mask for every decision; counts the tokens it is told of."""

    def __init__(self, mask):
        self.mask, self.told = mask, []

    def allowed(self):
        return self.mask

    def advance(self, token):
        self.told.append(token)


class Alternating:
    """Even tokens after an odd one and odd after an even one: a state that the chosen token moves."""

    def __init__(self, n_token):
        self.even = np.arange(n_token) % 2 == 0
        self.last = 1

    def allowed(self):
        return self.even if self.last % 2 else ~self.even

    def advance(self, token):
        self.last = token


def _mask(rng, n_token, closed=(50, 120)):
    mask = rng.random(n_token) < 0.4
    mask[closed[0]:closed[1]] = False  # the second tail cluster closed whole
    mask[3] = True
    return mask


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_an_all_allowing_constraint_changes_no_token(mode):
    rng = np.random.default_rng(1)
    rows = [_row(rng, LAYOUT) for _ in range(80)]
    for clusters in (None, LAYOUT):
        plain = Sampler(SamplingParams(seed=4, **mode), LAYOUT.n_token, [1, 2], clusters=clusters)
        masked = Sampler(SamplingParams(seed=4, **mode), LAYOUT.n_token, [1, 2], clusters=clusters,
                         constraint=Fixed(np.ones(LAYOUT.n_token, dtype=bool)))
        assert [plain.choose(full) for _, _, full in rows] == [masked.choose(full) for _, _, full in rows]
        assert masked.constraint.told == masked.generated


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_masked_tokens_are_never_chosen_and_lazy_equals_full(mode):
    """On the full row and lazily (head first, tails on demand), a stateful constraint's masks hold at every step;
    the lazy decision and `choose_parts` make the same decisions with the same draws; a greedy one chooses the
    masked row's first maximum."""
    rng = np.random.default_rng(2)
    rows = [_row(rng, LAYOUT) for _ in range(120)]
    params = SamplingParams(seed=9, **mode)
    full_row = Sampler(params, LAYOUT.n_token, [5], constraint=Alternating(LAYOUT.n_token))
    lazy = Sampler(params, LAYOUT.n_token, [5], clusters=LAYOUT, constraint=Alternating(LAYOUT.n_token))
    parts = Sampler(params, LAYOUT.n_token, [5], clusters=LAYOUT, constraint=Alternating(LAYOUT.n_token))
    last = [1, 1]
    for head, tails, full in rows:
        want_parity = 0 if last[0] % 2 else 1
        if params.greedy:
            s = full_row.scores(full)
            assert np.isinf(s[np.arange(LAYOUT.n_token) % 2 != want_parity]).all()
        a = full_row.choose(full)
        b = decide_lazily(lazy, head, tails).token
        c = parts.choose_parts(head, tails)
        assert a % 2 == want_parity and b % 2 == (0 if last[1] % 2 else 1)
        assert b == c
        if params.greedy:
            assert a == b
        last = [a, b]


def test_the_factored_decision_follows_the_masked_distribution_and_skips_closed_clusters():
    """6,000 lazy draws from one row under a fixed mask that closes the last tail cluster: excluded tokens never
    drawn, each token's frequency within 4.5 standard deviations of the masked full row's probability, and the
    closed cluster never computed."""
    rng = np.random.default_rng(7)
    head, tails, full = _row(rng, LAYOUT)
    mask = _mask(rng, LAYOUT.n_token)
    for mode in (dict(temperature=1.0), dict(temperature=1.4, top_p=0.9)):
        params = SamplingParams(seed=3, **mode)
        ref = Sampler(params, LAYOUT.n_token, constraint=Fixed(mask))
        want = filtered_weights(ref.scores(full), params.temperature, params.top_k, params.top_p, params.min_p)
        want = want / want.sum()
        assert (want[~mask] == 0).all()
        sampler = Sampler(params, LAYOUT.n_token, clusters=LAYOUT, constraint=Fixed(mask))
        n = 6_000
        tokens = [decide_lazily(sampler, head, tails).token for _ in range(n)]
        freq = np.bincount(tokens, minlength=LAYOUT.n_token) / n
        assert (freq[want == 0] == 0).all()
        live = want * n >= 5
        assert (np.abs(freq - want)[live] <= 4.5 * np.sqrt(want * (1 - want) / n)[live]).all()
        assert sampler.tail_counts[1] == 0  # the closed cluster: never revealed


def test_masked_seeded_sampling_is_deterministic():
    rng = np.random.default_rng(3)
    rows = [_row(rng, LAYOUT) for _ in range(50)]
    runs = []
    for _ in range(2):
        s = Sampler(SamplingParams(seed=11, temperature=1.2, top_k=15), LAYOUT.n_token, clusters=LAYOUT,
                    constraint=Alternating(LAYOUT.n_token))
        runs.append([decide_lazily(s, h, t).token for h, t, _ in rows])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("clusters", [None, LAYOUT])
def test_a_mask_that_leaves_nothing_is_a_one_line_error(clusters):
    _, _, full = _row(np.random.default_rng(0), LAYOUT)
    sampler = Sampler(SamplingParams(seed=0), LAYOUT.n_token, clusters=clusters,
                      constraint=Fixed(np.zeros(LAYOUT.n_token, dtype=bool)))
    with pytest.raises(InputError, match="the constraint allows none") as e:
        sampler.choose(full)
    assert "\n" not in str(e.value)
    # a mask that keeps only what another step removes (a stop token before min_tokens) leaves nothing either
    only_stop = np.zeros(LAYOUT.n_token, dtype=bool)
    only_stop[7] = True
    banned = Sampler(SamplingParams(seed=0, min_tokens=2, stop_token_ids=(7,)), LAYOUT.n_token, clusters=clusters,
                     constraint=Fixed(only_stop))
    with pytest.raises(InputError, match="no token is left"):
        banned.choose(full)


def test_a_mask_of_the_wrong_shape_is_refused():
    _, _, full = _row(np.random.default_rng(0), LAYOUT)
    sampler = Sampler(SamplingParams(), LAYOUT.n_token, constraint=Fixed(np.ones(5, dtype=bool)))
    with pytest.raises(InputError, match=r"booleans \[120\]"):
        sampler.choose(full)
