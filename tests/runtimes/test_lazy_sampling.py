"""The cluster-factored sampler of adaptive-softmax models (runtimes/sampling/factored.py): on bit-identical inputs
the lazy path (`start` on the head, tails revealed on demand) makes the decisions `choose_parts` and `choose` make,
with the same draws; against the plain full-row sampler (no clusters), greedy chooses its token and a draw only
tokens its filters keep; the tokens follow the distribution every step defines (`filtered_weights` of `scores` on
the full row); decisions skip exactly the tails the bounds allow. Synthetic adaptive distributions: a Zipf-like
head, tails from random logits, computed as an adaptive softmax computes them (float32, the tail's log-softmax added
to its head log-prob).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.lazy_decisions import decide_lazily
from hypothesis import given, settings
from hypothesis import strategies as st

from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, filtered_weights, top_logprobs
from txl_deploy.runtimes.sampling.bounds import MASS_MARGIN

LAYOUTS = [Clusters(20, [(20, 60)]), Clusters(30, [(30, 50), (50, 120)]),
           Clusters(16, [(16, 24), (24, 64), (64, 200)])]


def _log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


def _rows(rng, clusters, n, tail_mass=0.15, sharp=1.0):
    """n rows of (head [shortlist + n] float32, tails, full [V] float32), as the graphs give them: the head graph's
    cluster column and the log-sum-exp of its tail's float32 log-probs agree to rounding, not always to the bit."""
    out = []
    for _ in range(n):
        short = -sharp * 1.1 * np.log(1 + rng.permutation(clusters.shortlist)) + rng.normal(0, 0.5, clusters.shortlist)
        lp_short = _log_softmax(short) + np.log1p(-tail_mass)
        share = rng.dirichlet(np.ones(clusters.n_clusters))
        head = np.empty(clusters.head_size)
        head[:clusters.shortlist] = lp_short
        tails = []
        for i, (lo, hi) in enumerate(clusters.bounds, start=1):
            head[clusters.head_column(i)] = np.log(tail_mass * share[i - 1])
        head = _log_softmax(head).astype(np.float32)
        for i, (lo, hi) in enumerate(clusters.bounds, start=1):
            tail = _log_softmax(rng.normal(0, 2, hi - lo)).astype(np.float32)
            tails.append((head[clusters.head_column(i)] + tail).astype(np.float32))
        full = np.concatenate([head[:clusters.shortlist]] + tails)
        out.append((head, tails, full))
    return out


MODES = [dict(temperature=0), dict(temperature=1.0), dict(temperature=0.6), dict(temperature=1.7),
         dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_k=40), dict(temperature=1.0, top_p=0.5),
         dict(temperature=0.9, top_p=0.95), dict(temperature=1.0, min_p=0.1), dict(temperature=1.5, min_p=0.02),
         dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.02),
         dict(temperature=0, repetition_penalty=1.5, no_repeat_ngram_size=2, logprobs=5),
         dict(temperature=1.0, repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=-0.5,
              logit_bias={21: 6.0, 3: -100.0, 70: 3.0}),
         dict(temperature=0.8, top_k=10, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
              min_tokens=5, stop_token_ids=(1, 2), logprobs=3),
         dict(temperature=1.1, top_p=0.8, min_p=0.05, no_repeat_ngram_size=3, logit_bias={25: 8.0}, logprobs=20)]


def _layouts_for(params):
    """The layouts whose vocabulary holds every token id the parameters name; a Sampler refuses the others."""
    fit = []
    for clusters in LAYOUTS:
        ids = [*params.logit_bias, *params.stop_token_ids]
        if all(t < clusters.n_token for t in ids):
            fit.append(clusters)
        else:
            with pytest.raises(InputError, match="outside the vocabulary"):
                Sampler(params, clusters.n_token, clusters=clusters)
    assert len(fit) >= 2, f"{params}: the test must run on at least two layouts, it fits {len(fit)}"
    return fit


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_lazy_path_makes_the_same_decisions_with_the_same_draws_on_the_same_inputs(mode):
    """The promise: the factored decision is one algorithm, so on bit-identical head and tails the lazy path
    (`start`/`reveal`), `choose_parts` and `choose` on the full row choose the same tokens and leave their
    generators in the same state. `choose` derives the head from the row (`head_from_full`, float32), so it is fed
    the rows' derived heads here."""
    rng = np.random.default_rng(len(str(mode)))
    params = SamplingParams(**mode, seed=9, max_tokens=2000)
    for clusters in _layouts_for(params):
        vocab = clusters.n_token
        context = rng.integers(0, vocab, size=12).tolist()
        lazy = Sampler(params, vocab, context, clusters=clusters)
        parts = Sampler(params, vocab, context, clusters=clusters)
        whole = Sampler(params, vocab, context, clusters=clusters)
        for _, tails, full in _rows(rng, clusters, 1000 // len(LAYOUTS) + 1):
            head = clusters.head_from_full(full)  # the inputs `choose` sees, bit for bit
            choice = decide_lazily(lazy, head, tails)
            assert set(choice.revealed) <= set(range(1, clusters.n_clusters + 1))
            tok = parts.choose_parts(head, tails)
            assert choice.token == tok == whole.choose(full)
            assert choice.logprob == float(full[tok])
            if params.logprobs:
                assert choice.top_logprobs == top_logprobs(full, params.logprobs)
        assert lazy.generated == parts.generated == whole.generated
        assert lazy.rng.bit_generator.state == parts.rng.bit_generator.state == whole.rng.bit_generator.state


@pytest.mark.parametrize("mode", MODES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_lazy_path_against_the_plain_full_row_sampler(mode):
    """Against the sampler without clusters (the whole row, token by token), fed the same history: greedy chooses
    its token, a draw only a token its filters keep (the factored draw consumes its uniforms differently, so the
    sampled tokens themselves differ: their distribution is checked below), and the log-probs reported are the
    row's."""
    rng = np.random.default_rng(len(str(mode)) + 1)
    params = SamplingParams(**mode, seed=9, max_tokens=2000)
    for clusters in _layouts_for(params):
        vocab = clusters.n_token
        context = rng.integers(0, vocab, size=12).tolist()
        lazy = Sampler(params, vocab, context, clusters=clusters)
        plain = Sampler(params, vocab, context)
        for head, tails, full in _rows(rng, clusters, 1000 // len(LAYOUTS) + 1):
            want = _reference(plain, full)
            choice = decide_lazily(lazy, head, tails)
            if params.greedy:
                assert choice.token == plain.choose(full)
            else:
                assert want[choice.token] > 0
                plain._commit(choice.token, ())  # the same history for the penalties
            assert choice.logprob == float(full[choice.token])
            if params.logprobs:
                assert choice.top_logprobs == top_logprobs(full, params.logprobs)
        assert lazy.generated == plain.generated


def _reference(sampler, full):
    """The distribution steps 1-7 define on the full row."""
    p = sampler.params
    s = sampler.scores(full)
    if p.greedy:
        w = np.zeros(s.size)
        w[int(np.argmax(s))] = 1
        return w
    w = filtered_weights(s, p.temperature, p.top_k, p.top_p, p.min_p)
    return w / w.sum()


@pytest.mark.parametrize("mode", [m for m in MODES if m["temperature"] > 0][:11],
                         ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_tokens_follow_the_distribution_of_the_full_computation(mode):
    """8,000 draws from one row (a fixed history: the penalties see the same context each time): every token's
    frequency within 4.5 standard deviations of its reference probability (tokens expected 5 times or more), excluded tokens never drawn, and a
    chi-square statistic far below what a wrong distribution gives. The 5-token model of the second layout's
    shape keeps every cluster drawn often, so rejections and acceptances both happen."""
    rng = np.random.default_rng(5)
    clusters = LAYOUTS[1]
    head, tails, full = _rows(rng, clusters, 1, tail_mass=0.4)[0]
    params = SamplingParams(**mode, seed=3, max_tokens=10)
    context = [1, 2, 40, 21]
    want = _reference(Sampler(params, clusters.n_token, context), full)
    sampler = Sampler(params, clusters.n_token, context, clusters=clusters)
    n = 8_000
    tokens = []
    for _ in range(n):
        sampler.generated, sampler.counts[:] = [], 0
        tokens.append(decide_lazily(sampler, head, tails).token)
    freq = np.bincount(tokens, minlength=clusters.n_token) / n
    assert (freq[want == 0] == 0).all()
    live = want * n >= 5  # the chi-square's cells; the rarer tokens pooled into one
    assert (np.abs(freq - want)[live] <= 4.5 * np.sqrt(want * (1 - want) / n)[live]).all()
    rare = ~live & (want > 0)
    cells_f = np.append(freq[live], freq[rare].sum())
    cells_p = np.append(want[live], want[rare].sum())
    cells_f, cells_p = cells_f[cells_p > 0], cells_p[cells_p > 0]
    chi2 = float(np.sum((cells_f - cells_p) ** 2 / cells_p) * n)
    dof = cells_p.size - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10


def _kth(x, k):
    return float(np.sort(x)[-k]) if x.size >= k else -np.inf


def test_tails_are_skipped_exactly_where_the_bounds_allow():
    """A model that puts 10% of its mass in the tails (2-5% per cluster), 400 decisions, and 100 where the tails
    hold 60%; each decision held to what the bounds imply (no step changes a score here, so a cluster's bound is its
    head log-prob h_i):

    - greedy, top-k 10 and the top-3 log-probs reveal tail i when h_i reaches the best (k-th) score over the whole
      row, and never when it stays below the best (k-th) of the shortlist: what is known only raises that score;
    - at T = 1 a tail is needed when the first draw lands in its block, which has probability W_i / Z (W_i the
      cluster's mass bound, Z the blocks' total): the counts lie within 4.5 standard deviations of the sum of those
      probabilities, over the rows (a rejection's second draw, at most 1e-4 of the mass, may add one)."""
    rng = np.random.default_rng(2)
    clusters = LAYOUTS[2]
    rows = _rows(rng, clusters, 400, tail_mass=0.1, sharp=2.0)
    cols = [clusters.head_column(i) for i in range(1, clusters.n_clusters + 1)]
    mixed = rows + _rows(rng, clusters, 100, tail_mass=0.6, sharp=0.5)
    for mode, k, strict in ((dict(temperature=0), 1, True), (dict(temperature=0.7, top_k=10), 10, False),
                            (dict(temperature=0, logprobs=3), 3, False)):
        T = mode["temperature"] or 1.0
        sampler = Sampler(SamplingParams(**mode, seed=1, max_tokens=1000), clusters.n_token, clusters=clusters)
        must = np.zeros(clusters.n_clusters, dtype=np.int64)
        for head, tails, full in mixed:
            revealed = set(decide_lazily(sampler, head, tails).revealed)
            h = head[cols].astype(np.float64) / T  # as the sampler scales them: float64 scores / T
            known = _kth(head[:clusters.shortlist].astype(np.float64) / T, k)
            whole = _kth(full.astype(np.float64) / T, k)
            for i in range(1, clusters.n_clusters + 1):
                if i in revealed:  # greedy: the cluster's ids follow the shortlist's, so a tie keeps the first
                    assert h[i - 1] > known if strict else h[i - 1] >= known, (mode, i, h, known)
                if (h[i - 1] > whole) if strict else (h[i - 1] >= whole):
                    assert i in revealed, (mode, i, h, whole)
                    must[i - 1] += 1
        assert sampler.decisions == len(mixed)
        fractions = sampler.tail_fractions()
        assert (0 < fractions).all() and (fractions < 1).all(), (mode, fractions)  # both outcomes happen
        assert (sampler.tail_counts >= must).all(), (mode, sampler.tail_counts, must)

    sampler = Sampler(SamplingParams(temperature=1.0, seed=1, max_tokens=1000), clusters.n_token, clusters=clusters)
    expect, var = np.zeros(clusters.n_clusters), np.zeros(clusters.n_clusters)
    for head, tails, _ in rows:
        decide_lazily(sampler, head, tails)
        x = head.astype(np.float64)
        m = max(float(x[:clusters.shortlist].max()), float(x[cols].max()))
        mass = (1 + MASS_MARGIN) * np.exp(x[cols] - m)
        q = mass / (np.exp(x[:clusters.shortlist] - m).sum() + mass.sum())
        expect += q
        var += q * (1 - q)
    assert (np.abs(sampler.tail_counts - expect) <= 4.5 * np.sqrt(var) + 1).all(), (sampler.tail_counts, expect)
    assert (expect < 0.1 * len(rows)).all()  # the tails are skipped in most decisions: 2-5% of the mass each


def test_a_flat_head_reveals_its_heaviest_cluster():
    clusters = LAYOUTS[2]
    # revealing everything is always right, never wrong: a tail of a flat head is needed
    flat = Sampler(SamplingParams(temperature=0), clusters.n_token, clusters=clusters)
    head = np.full(clusters.head_size, np.log(1 / clusters.head_size), dtype=np.float32)
    head[clusters.head_column(3)] = 0.0
    tails = [np.full(hi - lo, -np.log(hi - lo) + head[clusters.head_column(i)], dtype=np.float32)
             for i, (lo, hi) in enumerate(clusters.bounds, start=1)]
    assert decide_lazily(flat, head, tails).revealed == (3,)


def test_without_clusters_everything_is_as_before():
    rng = np.random.default_rng(4)
    rows = [r[2] for r in _rows(rng, LAYOUTS[0], 50)]
    params = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=1.2, seed=8, logprobs=2, max_tokens=100)
    a, b = Sampler(params, 60, [1, 2]), Sampler(params, 60, [1, 2])
    for row in rows:
        choice = a.start(row)
        assert choice.needs == () and choice.revealed == ()
        assert choice.token == b.choose(row)
        assert choice.top_logprobs == top_logprobs(row, 2) and choice.logprob == float(row[choice.token])
    assert a.rng.bit_generator.state == b.rng.bit_generator.state


def test_layout_head_and_refusals():
    class Config:
        n_clusters, cutoffs, n_token = 2, [10, 30], 60

    c = Clusters.of(Config)
    assert c.shortlist == 10 and c.bounds == ((10, 30), (30, 60)) and c.head_column(1) == 11 and c.head_column(2) == 10
    Config.n_clusters, Config.cutoffs = 0, []
    assert Clusters.of(Config) is None
    for gap in ([(10, 30), (31, 60)], [(10, 30), (30, 30), (30, 60)], [(9, 30), (30, 60)], []):
        with pytest.raises(ValueError, match="without gaps"):
            Clusters(10, gap)
    rng = np.random.default_rng(0)
    head, tails, full = _rows(rng, c, 1)[0]
    derived = c.head_from_full(full)
    np.testing.assert_allclose(derived, head, atol=1e-5)
    assert derived.dtype == np.float32 and derived.shape == (c.head_size,)  # the head graph's
    for i, (lo, hi) in enumerate(c.bounds, start=1):  # still a bound of the cluster's tokens, after the rounding
        assert derived[c.head_column(i)] >= full[lo:hi].max()
    np.testing.assert_array_equal(c.head_from_full(np.stack([full, full])), np.stack([derived, derived]))
    np.testing.assert_array_equal(c.compose(head, tails), full)
    s = Sampler(SamplingParams(temperature=1.0, seed=0), 60, clusters=c)
    with pytest.raises(InputError, match="head log-probs have 60 entries"):
        s.start(full)
    heavy = np.log(np.full(12, 0.01))
    heavy[c.head_column(1)] = np.log(0.89)  # greedy must see cluster 1
    choice = Sampler(SamplingParams(temperature=0), 60, clusters=c).start(heavy)
    assert choice.needs == (1,)
    with pytest.raises(InputError, match="was not asked for"):
        choice.reveal(7, tails[0])
    with pytest.raises(InputError, match="has .* tokens, got 3 log-probs"):
        choice.reveal(choice.needs[0], np.zeros(3))
    with pytest.raises(InputError, match="the clusters cover 60 tokens, the vocabulary 61"):
        Sampler(SamplingParams(), 61, clusters=c)
    banned = Sampler(SamplingParams(temperature=0.5, no_repeat_ngram_size=1), 60, list(range(60)), clusters=c)
    with pytest.raises(InputError, match="no token is left"):
        banned.choose(full)


@settings(max_examples=60, deadline=None)
@given(layout=st.integers(0, 2), seed=st.integers(0, 2**32 - 1), temperature=st.sampled_from([0, 0.3, 1.0, 2.5]),
       top_k=st.sampled_from([None, 1, 3, 50]), top_p=st.sampled_from([1.0, 0.3, 0.9]),
       min_p=st.sampled_from([0.0, 0.05, 0.5]), rep=st.sampled_from([1.0, 0.8, 1.6]),
       presence=st.sampled_from([0.0, -2.0, 1.0]), sharp=st.sampled_from([0.2, 1.0, 3.0]),
       tail_mass=st.sampled_from([0.01, 0.3, 0.9]))
def test_lazy_equals_full_and_draws_only_allowed_tokens(layout, seed, temperature, top_k, top_p, min_p, rep, presence,
                                                        sharp, tail_mass):
    rng = np.random.default_rng(seed)
    clusters = LAYOUTS[layout]
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
                            presence_penalty=presence, logit_bias={int(rng.integers(clusters.n_token)): 5.0},
                            seed=seed, logprobs=2, max_tokens=100)
    context = rng.integers(0, clusters.n_token, 6).tolist()
    lazy = Sampler(params, clusters.n_token, context, clusters=clusters)
    whole = Sampler(params, clusters.n_token, context, clusters=clusters)
    for head, tails, full in _rows(rng, clusters, 8, tail_mass=tail_mass, sharp=sharp):
        want = _reference(whole, full)
        tok = decide_lazily(lazy, head, tails).token
        assert tok == whole.choose(full)
        assert want[tok] > 0
    assert lazy.rng.bit_generator.state == whole.rng.bit_generator.state
