"""The one sampler (runtimes/sampling.py) against independent definitions: HuggingFace's logits processors (the
oracle, from the test extra) on random and on the demo model's real log-probs, OpenAI's documented penalty formula
written out here, and the statistics of the draw. Every bad value is refused with a message naming it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation import logits_process as lp_mod

from txl_deploy.errors import InputError
from txl_deploy.runtimes.sampling import (
    Sampler,
    SamplingParams,
    banned_ngram_tokens,
    draw,
    filtered_weights,
    openai_penalties,
    repetition_penalty,
    top_logprobs,
)


def _random_log_probs(rng, n, vocab):
    logits = rng.normal(0, 3, size=(n, vocab))
    return (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)


@pytest.fixture(scope="module")
def real_log_probs():
    """The demo model's next-character log-probs along 200 characters of its held-out text."""
    from txl_deploy.assets import demo_heldout_path, demo_model_path
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(demo_model_path(), backend="torch-fast", threads=1) as rt:
        ids = rt.encode(demo_heldout_path().read_text(encoding="utf-8")[:200])
        return rt.step(ids[None])[0], ids


def _sources(real_log_probs):
    rng = np.random.default_rng(0)
    yield "random", _random_log_probs(rng, 40, 97), rng.integers(0, 97, size=60)
    lp, ids = real_log_probs
    yield "demo model", lp[::5], ids


def _hf(processors, context, scores):
    """HuggingFace's processors in float64 on one row."""
    out = torch.tensor(np.asarray(scores, np.float64))[None]
    ids = torch.tensor(np.asarray(context, np.int64))[None]
    for p in processors:
        out = p(ids, out)
    return out[0].numpy()


# -- each step against its definition -------------------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_is_huggingfaces(real_log_probs, penalty):
    for name, lps, ctx in _sources(real_log_probs):
        for lp in lps:
            context = ctx[:25]
            want = _hf([lp_mod.RepetitionPenaltyLogitsProcessor(penalty)], context, lp)
            np.testing.assert_allclose(repetition_penalty(lp, context, penalty), want, rtol=1e-12, err_msg=name)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_no_repeat_ngram_bans_what_huggingface_bans(n):
    rng = np.random.default_rng(n)
    for _ in range(50):
        ids = rng.integers(0, 6, size=int(rng.integers(0, 30)))  # a small alphabet: n-grams repeat often
        want = _hf([lp_mod.NoRepeatNGramLogitsProcessor(n)], ids, np.zeros(6))
        assert banned_ngram_tokens(ids, n) == np.flatnonzero(np.isneginf(want)).tolist()


def test_presence_and_frequency_penalties_follow_openais_formula():
    # OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, c[j] = how often token j
    # was sampled before the current position.
    rng = np.random.default_rng(1)
    mu = rng.normal(size=30)
    generated = rng.integers(0, 30, size=40).tolist()
    want = mu.copy()
    for j in range(30):
        c = generated.count(j)
        want[j] = mu[j] - c * 0.7 - float(c > 0) * -1.2
    counts = np.bincount(generated, minlength=30)
    np.testing.assert_allclose(openai_penalties(mu, counts, presence=-1.2, frequency=0.7), want, rtol=0, atol=1e-12)
    # in the sampler, the counts are those of the tokens it generated, not the prompt's
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    s = Sampler(params, 30, context=[3, 3, 3])
    for tok in generated:
        s.generated.append(tok)
        s.counts[tok] += 1
    np.testing.assert_allclose(s.scores(mu), openai_penalties(mu, counts, 0.5, 0.25))


WARPERS = [dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(temperature=1.0, top_p=0.8),
           dict(temperature=0.9, top_k=20, top_p=0.5, min_p=0.05), dict(temperature=1.0, min_p=0.2),
           dict(temperature=2.0, top_p=0.95, min_p=0.01)]


def _hf_warpers(w):
    out = [lp_mod.TemperatureLogitsWarper(w["temperature"])]
    if w.get("top_k"):
        out.append(lp_mod.TopKLogitsWarper(w["top_k"]))
    if w.get("top_p", 1) < 1:
        out.append(lp_mod.TopPLogitsWarper(w["top_p"]))
    if w.get("min_p"):
        out.append(lp_mod.MinPLogitsWarper(w["min_p"]))
    return out


@pytest.mark.parametrize("warper", WARPERS, ids=lambda w: ",".join(f"{k}={v}" for k, v in w.items()))
def test_temperature_top_k_top_p_min_p_give_huggingfaces_distribution(real_log_probs, warper):
    for name, lps, _ in _sources(real_log_probs):
        for lp in lps:
            want = torch.softmax(torch.tensor(_hf(_hf_warpers(warper), [0], lp)), -1).numpy()
            w = filtered_weights(lp, warper["temperature"], warper.get("top_k"), warper.get("top_p", 1.0),
                                 warper.get("min_p", 0.0))
            got = w / w.sum()
            assert ((got > 0) == (want > 0)).all(), name
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-15, err_msg=name)


def test_every_step_in_order_is_huggingfaces_pipeline(real_log_probs):
    """logit_bias, repetition penalty, n-gram bans, min_tokens, temperature, top-k, top-p, min-p, in HuggingFace
    generate()'s order (SequenceBias single-token biases for logit_bias, MinNewTokensLength for min_tokens)."""
    rng = np.random.default_rng(2)
    for name, lps, ctx in _sources(real_log_probs):
        vocab = lps.shape[1]
        bias = {int(t): float(b) for t, b in zip(rng.choice(vocab, 4, replace=False), (-100, 3.5, -2.0, 100))}
        params = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02, repetition_penalty=1.4,
                                no_repeat_ngram_size=2, logit_bias=bias, min_tokens=3, stop_token_ids=(1, 2),
                                max_tokens=50)
        prompt = ctx[:20].tolist()
        sampler = Sampler(params, vocab, context=prompt)
        hf = [lp_mod.SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}),
              lp_mod.RepetitionPenaltyLogitsProcessor(1.4), lp_mod.NoRepeatNGramLogitsProcessor(2),
              lp_mod.MinNewTokensLengthLogitsProcessor(len(prompt), 3, [1, 2]),
              *_hf_warpers(dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02))]
        for lp in lps[:12]:
            want = torch.softmax(torch.tensor(_hf(hf, prompt + sampler.generated, lp)), -1).numpy()
            w = filtered_weights(sampler.scores(lp), 0.8, 30, 0.9, 0.02)
            np.testing.assert_allclose(w / w.sum(), want, rtol=1e-9, atol=1e-15, err_msg=name)
            tok = sampler.choose(lp)
            assert want[tok] > 0  # the token drawn is one HuggingFace could draw


def test_greedy_with_penalties_is_the_argmax_of_huggingfaces_scores(real_log_probs):
    lps, ids = real_log_probs
    params = SamplingParams(temperature=0, repetition_penalty=1.5, no_repeat_ngram_size=3)
    sampler = Sampler(params, lps.shape[1], context=ids[:10])
    hf = [lp_mod.RepetitionPenaltyLogitsProcessor(1.5), lp_mod.NoRepeatNGramLogitsProcessor(3)]
    for lp in lps[10:60]:
        want = int(np.argmax(_hf(hf, ids[:10].tolist() + sampler.generated, lp)))
        assert sampler.choose(lp) == want


# -- the draw ---------------------------------------------------------------------------------------------------
def test_draws_follow_the_distribution_and_one_uniform_per_token():
    rng = np.random.default_rng(3)
    lp = _random_log_probs(rng, 1, 12)[0]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=10_000)
    sampler = Sampler(params, 12)
    tokens = [sampler.choose(lp) for _ in range(20_000)]
    w = filtered_weights(lp, 1.0, None, 0.9)
    p = w / w.sum()
    freq = np.bincount(tokens, minlength=12) / len(tokens)
    # 20,000 draws: each frequency within 4.5 standard deviations of its probability; excluded tokens never drawn
    assert (np.abs(freq - p) <= 4.5 * np.sqrt(p * (1 - p) / len(tokens)) + 1e-12).all()
    assert (freq[p == 0] == 0).all()
    # the same seed gives the same tokens, and each token is draw() of the next uniform of PCG64(seed)
    uniforms = np.random.default_rng(11).random(50)
    assert tokens[:50] == [draw(w, u) for u in uniforms]


def test_greedy_is_the_first_maximum_and_draws_nothing():
    s = Sampler(SamplingParams(temperature=0, seed=5), 4)
    state = s.rng.bit_generator.state
    assert s.choose(np.log([0.1, 0.4, 0.4, 0.1])) == 1
    assert s.rng.bit_generator.state == state


def test_top_logprobs_are_the_most_likely_first():
    lp = np.log(np.array([0.1, 0.3, 0.05, 0.3, 0.25]))
    assert [t for t, _ in top_logprobs(lp, 3)] == [1, 3, 4]
    assert top_logprobs(lp, 0) == [] and len(top_logprobs(lp, 20)) == 5
    assert top_logprobs(lp, 1)[0][1] == pytest.approx(np.log(0.3))


# -- refusals -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=True), "temperature must be a finite number >= 0"),
    (dict(top_k=0), "top_k must be a whole number >= 1"),
    (dict(top_k=2.5), "top_k must be a whole number >= 1"),
    (dict(top_p=0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.01), "top_p must be in \\(0, 1\\]"),
    (dict(min_p=-0.1), "min_p must be in \\[0, 1\\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=2.5), "presence_penalty must be in \\[-2, 2\\]"),
    (dict(frequency_penalty=-3), "frequency_penalty must be in \\[-2, 2\\]"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size must be a whole number >= 0"),
    (dict(logit_bias={"x": 1}), "logit_bias keys must be token ids"),
    (dict(logit_bias={3: 101}), "logit_bias\\[3\\] must be in \\[-100, 100\\]"),
    (dict(logit_bias=[1, 2]), "logit_bias must map token ids to numbers"),
    (dict(seed=-1), "seed must be a whole number >= 0"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop takes at most 4 strings"),
    (dict(stop=[""]), "stop strings must be non-empty strings"),
    (dict(stop_token_ids=[-2]), "stop token id must be a whole number >= 0"),
    (dict(max_tokens=-1), "max_tokens must be a whole number >= 0"),
    (dict(max_tokens=3, min_tokens=4), "min_tokens \\(4\\) must not exceed max_tokens \\(3\\)"),
    (dict(logprobs=21), "logprobs must be a whole number in \\[0, 20\\]"),
])
def test_out_of_range_values_are_refused(kwargs, message):
    with pytest.raises(InputError, match=message):
        SamplingParams(**kwargs)


def test_json_style_logit_bias_keys_and_vocabulary_checks():
    p = SamplingParams(logit_bias={"17": -100, 3: 2})
    assert p.logit_bias == {17: -100.0, 3: 2.0}
    with pytest.raises(InputError, match="logit_bias names token id 17, outside the vocabulary \\[0, 10\\)"):
        Sampler(p, 10)
    with pytest.raises(InputError, match="stop_token_ids names token id 12"):
        Sampler(SamplingParams(stop_token_ids=[12]), 10)


def test_every_token_excluded_is_an_error_not_a_silent_pick():
    s = Sampler(SamplingParams(no_repeat_ngram_size=1, temperature=0), 3, context=[0, 1, 2])
    with pytest.raises(InputError, match="no token is left"):
        s.choose(np.log([0.2, 0.3, 0.5]))


def test_token_generators_refuse_text_controls(tiny_onnx):
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(tiny_onnx) as rt:
        with pytest.raises(InputError, match="does not support stop: it produces token ids"):
            rt.generate([1, 2], params=SamplingParams(stop=["w3"]))
        with pytest.raises(InputError, match="does not support logprobs"):
            rt.generate([1, 2], params=SamplingParams(logprobs=2))
        with pytest.raises(InputError, match="either as params=SamplingParams"):
            rt.generate([1, 2], temperature=0, params=SamplingParams())
        with pytest.raises(InputError, match="unexpected keyword argument 'top_n'"):
            rt.generate([1, 2], top_n=3)
        assert rt.batch_size is None  # nothing was fed
        # the keyword controls and params= give the same tokens
        a = list(rt.generate([1, 2, 3], 12, temperature=0.9, seed=4, min_p=0.05, repetition_penalty=1.2))
        rt.reset()
        b = list(rt.generate([1, 2, 3], params=SamplingParams(temperature=0.9, seed=4, min_p=0.05,
                                                              repetition_penalty=1.2, max_tokens=12)))
        assert a == b and len(a) == 12


def test_seeded_sampling_is_the_same_on_every_backend(tiny_onnx, tiny_ckpt):
    """ONNX Runtime and the PyTorch reference give log-probs equal to ~1e-5: a seed gives the same tokens."""
    from txl_deploy.runtimes import TxlRuntime

    params = SamplingParams(temperature=1.0, top_p=0.95, min_p=0.01, repetition_penalty=1.1, seed=21, max_tokens=40)
    runs = []
    for path, backend in ((tiny_onnx, None), (tiny_ckpt, "torch"), (tiny_ckpt, "torch-fast")):
        with TxlRuntime.load(path, backend=backend, threads=1) as rt:
            runs.append(list(rt.generate("w1 w2 w3", params=params)))
    assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 40
