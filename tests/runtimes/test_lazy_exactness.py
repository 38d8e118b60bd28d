"""Lazy decoding is exact on a trained word model: computing the adaptive softmax's head first and a tail cluster only
when the sampler's decision can depend on it chooses the same tokens as the full distribution, in every sampling
mode, over 1,000+ generated tokens each.

The model is `tests/data/kjv-words/model` (examples/train_word.py: KJV words, three tail clusters), exported to
ONNX once for the module. A trained model's next-word distribution is peaked where a random model's is flat, so
how often a tail is needed here is what a deployed model sees; the test prints the fractions and checks what the
bounds imply for them.

Each step, the head is derived from the graph's full log-probs (the shortlist's log-probs and each cluster's log
total probability) and a tail, when asked for, is its tokens' slice of them. The full path (`choose` on the whole
distribution) and the lazy path (`start`, then `reveal` only what `needs` asks for) are two samplers with the same
seed, so a decision that depended on a tail it skipped, or a random draw taken out of step, shows as a different
token. Independently of the factored algorithm, every token is checked against the whole distribution: greedy's
is the best-scored one, a sampled one is one the filters keep, and the reported log-probs are the model's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from txl_deploy.runtimes import sampling
from txl_deploy.runtimes.evaluation import streaming_eval
from txl_deploy.runtimes.sampling.bounds import MASS_MARGIN

pytest.importorskip("torch")  # the export

WORD_DATA = Path(__file__).resolve().parents[1] / "data" / "kjv-words"
WORD_MODEL = WORD_DATA / "model"
HELDOUT = Path(__file__).resolve().parents[2] / "txl_deploy" / "assets" / "demo" / "heldout.txt"
lazy_path = pytest.mark.skipif(not hasattr(sampling.Sampler, "start"),
                               reason="the sampler has no lazy path (Sampler.start) in this checkout")
PROMPT = "And God said unto Moses,"
N_TOKENS = 1024  # generated per mode


def bias_on_tail_tokens(bounds) -> dict[int, float]:
    """+6 on the first five tokens of the last (rarest) cluster and +3 on five of the second: tokens whose biased
    score can pass the head's best, so the lazy path must open those tails whenever their cluster's mass allows."""
    bias = {t: 6.0 for t in range(bounds[-1][0], bounds[-1][0] + 5)}
    bias.update({t: 3.0 for t in range(bounds[1][0], bounds[1][0] + 5)})
    return bias


def modes(clusters) -> dict[str, dict]:
    bias = bias_on_tail_tokens(clusters.bounds)
    return {
        "greedy": {"temperature": 0.0},
        "T=1": {"temperature": 1.0},
        "T=0.7": {"temperature": 0.7},
        "T=1.3": {"temperature": 1.3},
        "top-k 40": {"temperature": 1.0, "top_k": 40},
        "top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
        "min-p 0.05": {"temperature": 1.0, "min_p": 0.05},
        "top-k 40 + top-p 0.9 + T=0.8": {"temperature": 0.8, "top_k": 40, "top_p": 0.9},
        "repetition penalty 1.3": {"temperature": 1.0, "repetition_penalty": 1.3},
        "repetition penalty 0.8": {"temperature": 1.0, "repetition_penalty": 0.8},
        "presence +0.8, frequency +0.4": {"temperature": 1.0, "presence_penalty": 0.8, "frequency_penalty": 0.4},
        "presence -0.8, frequency -0.4": {"temperature": 1.0, "presence_penalty": -0.8, "frequency_penalty": -0.4},
        "logit bias on tail tokens, greedy": {"temperature": 0.0, "logit_bias": bias},
        "logit bias on tail tokens, T=1": {"temperature": 1.0, "logit_bias": bias},
        "logprobs top-5": {"temperature": 1.0, "logprobs": 5},
        "ban_unk": {"temperature": 1.0, "ban_unk": True},
    }


@pytest.fixture(scope="module")
def word_rt(tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx
    from txl_deploy.runtimes import TxlRuntime

    out = tmp_path_factory.mktemp("kjv-words") / "kjv-words.onnx"
    export_onnx(WORD_MODEL, out, max_segment=16)
    with TxlRuntime.load(out, threads=1) as rt:
        yield rt


def first_draw_odds(clusters, head) -> np.ndarray:
    """Per tail cluster, the probability that the first draw of an unfiltered T = 1 decision lands in its block:
    W_i / Z, its mass bound over the blocks' total (docs/sampling.md), computed from the head alone."""
    cols = [clusters.head_column(i) for i in range(1, clusters.n_clusters + 1)]
    x = head.astype(np.float64)
    m = max(float(x[:clusters.shortlist].max()), float(x[cols].max()))
    mass = (1 + MASS_MARGIN) * np.exp(x[cols] - m)
    return mass / (np.exp(x[:clusters.shortlist] - m).sum() + mass.sum())


def run_mode(rt, clusters, controls: dict, seed: int) -> dict:
    """N_TOKENS tokens from one prompt, both paths side by side; returns the tokens, per-tail need fractions and,
    per tail, the sum and variance of the steps' first-draw odds (`first_draw_odds`)."""
    params = sampling.SamplingParams(seed=seed, max_tokens=N_TOKENS, **controls)
    prompt = rt.vocab.encode(PROMPT, add_eos=False)
    full = sampling.Sampler(params, rt.n_token, context=prompt, vocab=rt.vocab, clusters=clusters)
    lazy = sampling.Sampler(params, rt.n_token, context=prompt, vocab=rt.vocab, clusters=clusters)
    rt.reset()
    log_probs = rt.step(prompt[None])[0, -1]
    tokens = []
    odds, odds_var = np.zeros(clusters.n_clusters), np.zeros(clusters.n_clusters)
    for n in range(N_TOKENS):
        scores = full.scores(log_probs)  # steps 1-5 on the whole distribution, before the token joins the history
        want = full.choose(log_probs)
        head = clusters.head_from_full(log_probs)
        q = first_draw_odds(clusters, head)
        odds, odds_var = odds + q, odds_var + q * (1 - q)
        choice = lazy.start(head)
        while choice.needs:
            for i in choice.needs:
                lo, hi = clusters.bounds[i - 1]
                choice.reveal(i, log_probs[lo:hi])
        assert choice.token == want, f"step {n}: the lazy path chose {choice.token}, the full path {want}"
        # independent of the factored algorithm: the token is one the whole distribution's filters allow
        if params.greedy:
            assert scores[want] == scores.max(), f"step {n}: {want} is not the best-scored token"
        else:
            weights = sampling.filtered_weights(scores, params.temperature, params.top_k, params.top_p, params.min_p)
            assert weights[want] > 0, f"step {n}: {want} is outside what the filters keep"
        if params.logprobs is not None:
            top = sampling.top_logprobs(log_probs, params.logprobs)
            assert choice.logprob == pytest.approx(float(log_probs[want]), abs=1e-6)
            assert [t for t, _ in choice.top_logprobs] == [t for t, _ in top]
            assert [lp for _, lp in choice.top_logprobs] == pytest.approx([lp for _, lp in top], abs=1e-6)
        tokens.append(choice.token)
        log_probs = rt.step(np.array([[choice.token]]))[0, -1]
    return {"tokens": tokens, "fractions": lazy.tail_fractions().tolist(), "greedy": params.greedy,
            "first_draw": odds.tolist(), "first_draw_var": odds_var.tolist()}


def test_the_trained_word_model_is_the_one_its_training_record_describes(word_rt):
    """The exported checkpoint scores the held-out perplexity training.json recorded (streamed, memory threaded),
    with the adaptive softmax the tail statistics are about: three tail clusters, tied weights."""
    record = json.loads((WORD_DATA / "training.json").read_text(encoding="utf-8"))
    cfg = word_rt.config
    assert list(cfg.cutoffs) == record["config"]["cutoffs"] and len(cfg.cutoffs) == 3
    assert cfg.tie_weight and cfg.n_token == record["vocabulary"]["words"]
    word_rt.reset()
    ids = word_rt.vocab.encode(HELDOUT.read_text(encoding="utf-8"))
    scored = streaming_eval(ids, word_rt.step, cfg.tgt_len)
    assert 2.0 ** scored["bits_per_token"] == pytest.approx(record["heldout"]["perplexity"], rel=1e-3)


@pytest.fixture(scope="module")
def results(word_rt):
    clusters = sampling.Clusters.of(word_rt.config)
    assert clusters is not None and clusters.n_clusters == 3, "the trained word model has three tail clusters"
    out = {name: run_mode(word_rt, clusters, controls, seed=7) for name, controls in modes(clusters).items()}
    print("\nfraction of steps that needed tail 1, 2, 3 (kjv-words, "
          f"{N_TOKENS} tokens a mode):\n" + json.dumps({k: [round(f, 3) for f in v["fractions"]]
                                                         for k, v in out.items()}, indent=1))
    return out


@lazy_path
def test_every_mode_generates_its_tokens_with_the_same_choices(results):
    """run_mode asserted token by token; each mode ran its full length, and the sampled ones wrote many words
    (greedy falls into a loop of a few phrases on this small model, and negative presence and frequency penalties
    reward repeats: about 40 distinct words in 1,024)."""
    for name, r in results.items():
        assert len(r["tokens"]) == N_TOKENS, name
        least = 5 if r["greedy"] else 20
        assert len(set(r["tokens"])) > least, f"{name}: the stream is degenerate ({len(set(r['tokens']))} words)"


@lazy_path
def test_greedy_needs_a_tail_far_less_than_always(results):
    """Greedy needs tail i only where the cluster's whole probability reaches the best shortlist word's; on a trained
    model the next word is mostly a frequent one, so that is less than half the steps (about 0.45, 0.35, 0.35 for
    the three tails on this small model, whose distributions are still broad: held-out perplexity 100)."""
    fractions = results["greedy"]["fractions"]
    assert max(fractions) < 0.5, fractions
    # the rarest cluster holds the least mass, so greedy opens it no more often than the most frequent one
    assert fractions[-1] <= fractions[0] + 0.05, fractions


@lazy_path
def test_sampling_at_temperature_one_skips_most_tails(results):
    """At T=1 with no filter a tail is needed when the first draw lands in its block (a rejection's second draw,
    at most 1e-4 of the mass, rarely adds one): for every tail, the steps that needed it lie within 4.5 standard
    deviations of the sum of the steps' odds of that, about the cluster's probability, and that sum is far below
    the steps taken."""
    r = results["T=1"]
    needed = np.array(r["fractions"]) * N_TOKENS
    expect, sd = np.array(r["first_draw"]), np.sqrt(r["first_draw_var"])
    print(f"T=1: tails needed {needed.round().astype(int).tolist()} of {N_TOKENS} steps, expected "
          f"{expect.round(1).tolist()} +- {sd.round(1).tolist()}")
    assert (np.abs(needed - expect) <= 4.5 * sd + 1).all(), (needed, expect, sd)
    assert (expect < 0.3 * N_TOKENS).all(), expect


@lazy_path
def test_penalising_the_words_already_written_opens_the_tails_more_often(results):
    """Positive presence and frequency penalties lower the frequent (shortlist) words the text has used, so the
    rare clusters' bounds come closer to the best score; negative ones raise them and the tails are rarely needed."""
    lowered = results["presence +0.8, frequency +0.4"]["fractions"]
    raised = results["presence -0.8, frequency -0.4"]["fractions"]
    assert all(lo > hi for lo, hi in zip(lowered, raised)), (lowered, raised)


@lazy_path
def test_a_positive_bias_on_tail_tokens_opens_their_tails(results):
    """With +6 on five rare words, greedy's bound for the last cluster (its mass times e^6) often passes the best
    shortlist word: the lazy path must open that tail far more often than greedy without the bias."""
    biased = results["logit bias on tail tokens, greedy"]["fractions"]
    plain = results["greedy"]["fractions"]
    assert biased[-1] > plain[-1], (biased, plain)


@lazy_path
@pytest.mark.parametrize("mode", ["greedy", "T=1"])
def test_the_runtime_generates_lazily_with_the_full_paths_tokens(word_rt, results, mode):
    """TxlRuntime.generate on the exported parts (the head graph every token, a tail graph only when the sampler
    asks) writes the tokens the full distribution gave above, and counts about the same tail needs (its head comes
    from its own graph, so a need at a bound's edge may fall the other way)."""
    assert word_rt.backend.clusters is not None, "the export wrote the head and tail graphs beside the model"
    controls = modes(sampling.Clusters.of(word_rt.config))[mode]
    word_rt.reset()
    decisions, tails = word_rt.tail_stats["decisions"], list(word_rt.tail_stats["tails"])
    prompt = word_rt.vocab.encode(PROMPT, add_eos=False)
    got = list(word_rt.generate(prompt, max_new_tokens=N_TOKENS, seed=7, **controls))
    assert got == results[mode]["tokens"]
    assert word_rt.tail_stats["decisions"] - decisions == N_TOKENS
    counted = [(now - was) / N_TOKENS for now, was in zip(word_rt.tail_stats["tails"], tails)]
    assert counted == pytest.approx(results[mode]["fractions"], abs=0.02)
