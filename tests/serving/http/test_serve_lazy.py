"""The engine samples an adaptive-softmax model as TxlRuntime.generate does, token for token with the same seed.

generate samples such a model cluster by cluster (runtimes/sampling.py, docs/sampling.md): a plain sampler over the
same distributions draws other tokens, so the server's completions must be given the model's clusters. With
lazy=True (`serve --lazy`), on a backend with the softmax's parts, the engine also decodes as generate does: each
step computes the head of every row, and a tail only for the rows whose decision needs it, batched over them; the
tokens, log-probs, a session's next-token distribution and a refused request's error are then what generate's
path gives.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import numpy as np
import pytest
from helpers.engine_gate import EngineGate, EventRecorder

from txl_deploy.runtimes import SamplingParams, TxlRuntime
from txl_deploy.runtimes.lazy_decode import decide, full_log_probs
from txl_deploy.runtimes.sampling import Clusters, Sampler
from txl_deploy.serving.http.completion import Completion
from txl_deploy.serving.http.scheduler import Job, Scheduler

MODES = [
    {"temperature": 0.0},
    {"temperature": 1.0},
    {"temperature": 0.7, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.9},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 1.0, "repetition_penalty": 1.3},
    {"temperature": 1.0, "presence_penalty": 0.8, "frequency_penalty": 0.4},
    {"temperature": 1.0, "logit_bias": {40: 3.0, 12: 2.0}},
    {"temperature": 0.0, "logit_bias": {45: 4.0}},
]


def _prompts(count, seed):
    rng = np.random.default_rng(seed)
    # several longer than one segment (the tiny model's max_segment is 16), so prompts are fed in pieces
    return [rng.integers(0, 58, size=int(rng.integers(1, 40))).tolist() for _ in range(count)]


def _generated(make_rt, prompt, params):
    rt = make_rt()
    try:
        return list(rt.generate(prompt, params=dataclasses.replace(params, logprobs=None)))
    finally:
        rt.close()


@pytest.fixture
def engine(tiny_onnx):
    eng = Scheduler(TxlRuntime.load(tiny_onnx, threads=1), max_batch=8, max_sessions=2, max_queue=32, lazy=True)
    eng.start()
    yield eng
    eng.stop(10)


def test_a_completion_on_full_distributions_writes_generates_tokens(ort_rt, reference):
    """The lowest level: a Completion given the model's clusters, fed the full log-probs of each step, chooses the
    tokens TxlRuntime.generate (head and tails apart) chooses, in every mode; so does the scheduler's."""
    clusters = Clusters.of(ort_rt.config)
    assert clusters is not None and ort_rt.backend.clusters is not None  # the tiny model's adaptive softmax, parts
    for k, (controls, prompt) in enumerate(zip(MODES, _prompts(len(MODES), seed=1))):
        params = SamplingParams(seed=k, max_tokens=20, **controls)
        completion = Completion(params, ort_rt.vocab, ort_rt.n_token, context=prompt, clusters=clusters)
        ort_rt.reset()
        log_probs = ort_rt.prefill(np.array([prompt]))[0]
        tokens = []
        for _ in range(params.max_tokens):
            tokens.append(completion.next(log_probs).token)
            log_probs = ort_rt.prefill(np.array([[tokens[-1]]]))[0]
        assert tokens == _generated(reference, prompt, params), controls


def test_the_engine_decodes_lazily_with_generates_tokens_and_skips_tails(engine, reference):
    """Many streams at once, in every mode, rows of one batched head call per step: each gets exactly generate's
    tokens; every decision is counted, and the tails were computed for fewer rows than decided (the shortlist holds
    most of the head's mass)."""
    assert engine.lazy
    prompts = _prompts(2 * len(MODES), seed=2)
    params = [SamplingParams(seed=k, max_tokens=12 + k, **MODES[k % len(MODES)]) for k in range(len(prompts))]
    recs = [EventRecorder() for _ in prompts]
    with EngineGate(engine) as gate:  # all of them queued before the first step, so they share the decode steps
        for prompt, p, rec in zip(prompts, params, recs):
            engine.submit(Job(prompt, p, rec.emit))
        gate.open()
        for rec in recs:
            assert rec.done.wait(120)
    for prompt, p, rec in zip(prompts, params, recs):
        assert rec.events[-1][0] == "done", rec.events[-1]
        assert rec.tokens == _generated(reference, prompt, p), (p, prompt)
    decisions = sum(p.max_tokens for p in params)
    assert engine.tail_stats["decisions"] == decisions
    assert 0 < max(engine.tail_stats["tails"]) < decisions, engine.tail_stats


def test_lazy_log_probs_are_the_full_distributions(tiny_onnx, engine):
    """With logprobs, a lazily decided token's log-prob and alternatives are the model's: those the same stream
    reports when every step computes the full distribution (the engine's default)."""
    full = Scheduler(TxlRuntime.load(tiny_onnx, threads=1), max_batch=2, max_sessions=1)
    assert not full.lazy
    full.start()
    try:
        for controls in ({"temperature": 0.0, "logprobs": 5}, {"temperature": 1.0, "logprobs": 20}):
            params = SamplingParams(seed=3, max_tokens=15, **controls)
            lazy_rec, full_rec = EventRecorder(), EventRecorder()
            engine.submit(Job([4, 8, 15, 16, 23, 42], params, lazy_rec.emit))
            full.submit(Job([4, 8, 15, 16, 23, 42], params, full_rec.emit))
            assert lazy_rec.done.wait(60) and full_rec.done.wait(60)
            lazy_out = [p for k, p in lazy_rec.events if k == "token"]
            full_out = [p for k, p in full_rec.events if k == "token"]
            assert [o.token for o in lazy_out] == [o.token for o in full_out]
            for a, b in zip(lazy_out, full_out):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-6)
                assert list(a.top) == list(b.top)  # the same alternatives, most likely first
                assert list(a.top.values()) == pytest.approx(list(b.top.values()), abs=1e-6)
    finally:
        full.stop(10)


def test_a_session_continues_from_the_distribution_generate_leaves(engine, reference):
    """A session's request decoded lazily leaves its next-token distribution composed from the head and every tail:
    the log-probs TxlRuntime.generate leaves after the same stream, so the session continued without a prompt gets
    what generate continued without one gets."""
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first, then = SamplingParams(seed=5, max_tokens=7), SamplingParams(seed=6, max_tokens=5)
    session = engine.create_session()
    recs = [EventRecorder(), EventRecorder()]
    engine.submit(Job(prompt, first, recs[0].emit, session_id=session.id))
    assert recs[0].done.wait(60) and recs[0].events[-1][0] == "done"
    after_first = np.array(session.last_log_probs, copy=True)
    engine.submit(Job([], then, recs[1].emit, session_id=session.id))
    assert recs[1].done.wait(60) and recs[1].events[-1][0] == "done"
    rt = reference()
    try:
        assert recs[0].tokens == list(rt.generate(prompt, params=first))
        assert np.array_equal(after_first, rt.save_state()["__last_log_probs__"][0])  # generate composes it at the end
        assert recs[1].tokens == list(rt.generate(params=then))
        assert np.array_equal(session.last_log_probs, rt.save_state()["__last_log_probs__"][0])
    finally:
        rt.close()
    assert after_first.shape == (engine.n_token,) and np.isfinite(after_first).all()


def test_a_request_that_leaves_no_token_fails_alone_in_a_batched_decision(ort_rt):
    """decide(..., failed=): a row whose parameters exclude every token is reported and dropped, the rows beside it
    decide as they would alone; without `failed` the error is raised."""
    prompt = list(range(ort_rt.n_token))  # every token once: no_repeat_ngram_size=1 bans them all
    ort_rt.reset()
    ort_rt._ensure_state(2)
    hidden, head = ort_rt.backend.run_head(ort_rt._state, np.array([prompt[-16:]] * 2),
                                           np.full((2, 1), 15, dtype=np.int64))
    hidden, head = hidden[:, -1], head[:, -1]
    clusters = Clusters.of(ort_rt.config)
    banned = SamplingParams(temperature=1.0, seed=1, no_repeat_ngram_size=1)
    fine = SamplingParams(temperature=1.0, seed=1)

    def samplers():
        return [Sampler(banned, ort_rt.n_token, context=prompt, clusters=clusters),
                Sampler(fine, ort_rt.n_token, context=prompt, clusters=clusters)]

    refused = {}
    decision = decide(ort_rt.backend, samplers(), hidden, head, failed=refused.__setitem__)
    assert list(refused) == [0] and "no token is left" in str(refused[0])
    assert decision.choices[0] is None and decision.tokens[0] == -1
    alone = Sampler(fine, ort_rt.n_token, context=prompt, clusters=clusters)
    full = full_log_probs(ort_rt.backend, hidden, head)
    assert decision.tokens[1] == alone.choose(full[1])
    with pytest.raises(Exception, match="no token is left"):
        decide(ort_rt.backend, samplers(), hidden, head)


def test_the_engine_fails_only_the_request_that_leaves_no_token(engine, reference):
    """In the engine: that request gets a 400 error, the stream beside it goes on with generate's tokens."""
    every = list(range(engine.n_token))
    bad, good = EventRecorder(), EventRecorder()
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=10)
    with EngineGate(engine) as gate:
        engine.submit(Job(every, SamplingParams(temperature=1.0, no_repeat_ngram_size=1), bad.emit))
        engine.submit(Job([5, 6, 7], params, good.emit))
        gate.open()
        assert bad.done.wait(60) and good.done.wait(60)
    kind, error = bad.events[-1]
    assert kind == "error" and error.status == 400 and "no token is left" in str(error)
    assert good.events[-1][0] == "done" and good.tokens == _generated(reference, [5, 6, 7], params)
    assert engine.running == 0


def test_a_lazy_server_streams_generates_tokens(make_server, reference):
    """Over HTTP (`serve --lazy`'s engine): a seeded streamed completion's token ids are generate's."""
    srv = make_server(lazy=True)
    assert srv.engine.lazy
    body = {"prompt": "w1 w7 w3 w9", "max_tokens": 24, "temperature": 1.0, "top_p": 0.95, "seed": 11,
            "stream": True, "return_token_ids": True}
    ids = []
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    rt = reference()
    try:
        want = list(rt.generate("w1 w7 w3 w9", params=SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95,
                                                                      seed=11)))
    finally:
        rt.close()
    assert ids == want and srv.engine.tail_stats["decisions"] == 24
