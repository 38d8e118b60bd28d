"""Continuous batching: 32 concurrent streams are rows of one batched call and each gets exactly its tokens alone;
streams join and leave between steps; a long prompt goes in chunks between decode steps; a client that disconnects
frees its row within one step; beyond the queue, 429 with Retry-After."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers.engine_gate import EventRecorder

from txl_deploy.runtimes import SamplingParams, TxlRuntime
from txl_deploy.serving.http.scheduler import Job, Scheduler


def _prompts(count, seed=0):
    rng = np.random.default_rng(seed)
    # different lengths, several longer than one chunk (the tiny model's max_segment is 16)
    return [rng.integers(0, 58, size=int(rng.integers(1, 40))).tolist() for _ in range(count)]


def _sampled_alone(reference, prompt, params):
    """The tokens TxlRuntime.generate samples for one prompt alone, with these SamplingParams (seeded)."""
    rt = reference()
    try:
        return list(rt.generate(prompt, params=params))
    finally:
        rt.close()


def _hold_first_step(engine, ready):
    """The engine's next backend call waits until ready() (60 s at most), then calls go through as before.
    Returns the engine's own call, to put back."""
    run = engine.rows.run

    def first_step_waits(*args, **kwargs):
        end = time.monotonic() + 60
        while not ready() and time.monotonic() < end:
            time.sleep(0.005)
        engine.rows.run = run
        return run(*args, **kwargs)

    engine.rows.run = first_step_waits
    return run


def test_32_concurrent_streams_each_get_their_tokens_alone(server, alone):
    prompts = _prompts(32)
    n = 10
    barrier = threading.Barrier(32)
    batches = []
    engine = server.engine
    observe = engine.on_batch
    engine.on_batch = lambda size: (batches.append(size), observe(size))
    # the other 31 are queued behind the first stream's first step, so the streams overlap however fast the engine
    # is next to the clients (each opens its own connection)
    run = _hold_first_step(engine, lambda: engine.queue_depth >= 31)

    def one(prompt):
        barrier.wait(timeout=60)
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 5, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    try:
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, prompts))
    finally:
        engine.on_batch, engine.rows.run = observe, run
    for prompt, choice in zip(prompts, results):
        toks, lps = alone(prompt, n)
        assert choice["token_ids"] == toks
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], [lp[t] for lp, t in zip(lps, toks)],
                                   rtol=0, atol=1e-5)
    assert max(batches) > 8, batches  # the streams really ran as rows of shared calls


@pytest.fixture
def engine(tiny_onnx):
    """A scheduler with its backend calls recorded: (segment length, rows)."""
    eng = Scheduler(TxlRuntime.load(tiny_onnx), max_batch=4, max_sessions=2, max_queue=8, prefill_chunk=4)
    calls = []
    run = eng.rows.run

    def spy(handles, tokens, positions, **kwargs):
        calls.append((tokens.shape[1], tuple(int(h) for h in handles)))
        time.sleep(0.002)  # slow enough that a cancellation lands between steps
        return run(handles, tokens, positions, **kwargs)

    eng.rows.run = spy
    eng.calls = calls
    eng.start()
    yield eng
    eng.stop(10)


def test_a_long_prompt_is_fed_in_chunks_between_decode_steps(engine, reference):
    short, long_ = _prompts(1, seed=3)[0][:3], list(range(40)) + list(range(10))  # 50 tokens: 13 chunks of <= 4
    a, b = EventRecorder(), EventRecorder()
    # a runs for 200 steps (over 0.4 s), far longer than b's 13 chunks and 5 steps take, so a is still decoding
    # between b's chunks even when this thread is descheduled for a while after a's first token. Both sample with
    # a seed: the tiny random model's greedy tokens are all alike, and would not show a row mixed up with another.
    a_params, b_params = SamplingParams(temperature=1.0, seed=3, max_tokens=200), SamplingParams(temperature=1.0,
                                                                                                  seed=8, max_tokens=5)
    engine.submit(Job(short, a_params, a.emit))
    while not a.tokens:
        time.sleep(0.001)
    engine.submit(Job(long_, b_params, b.emit))
    assert a.done.wait(60) and b.done.wait(60)
    assert a.tokens == _sampled_alone(reference, short, a_params)
    # the long prompt's chunks, and between every two of them a decode step of the running stream
    chunk_calls = [i for i, (q, rows) in enumerate(engine.calls) if rows == (1,) and q > 1]
    assert len(chunk_calls) >= 12  # 50 tokens in chunks of 4 (the last chunk of 2)
    for i, j in itertools.pairwise(chunk_calls):
        between = engine.calls[i + 1:j]
        assert any(q == 1 and 0 in rows for q, rows in between), engine.calls[i:j + 1]
    # and the long one got what TxlRuntime.generate gives it alone when its prompt is fed in the same chunks (a
    # chunk attends to the memory, not to the whole prompt, so other chunks are another computation); generate
    # samples the tiny model's adaptive softmax cluster by cluster, drawing other numbers than a plain sampler
    rt = TxlRuntime.load(engine.rt.backend.path)
    try:
        for lo in range(0, len(long_), 4):
            rt.prefill(np.array([long_[lo:lo + 4]]))
        toks = list(rt.generate(params=b_params))  # continues the prompt fed; b has no penalty that reads it
    finally:
        rt.close()
    assert b.tokens == toks and len(set(toks + a.tokens)) > 10


def test_streams_join_and_leave_between_steps(engine, reference):
    recs = [EventRecorder() for _ in range(6)]
    prompts = _prompts(6, seed=5)
    lengths = [3, 12, 5, 20, 1, 8]
    # seeded sampling: a stream given another's row (or tokens) would write other tokens than it writes alone
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n) for i, n in enumerate(lengths)]
    for i, (rec, prompt, p) in enumerate(zip(recs, prompts, params)):
        engine.submit(Job(prompt, p, rec.emit))
        time.sleep(0.01 * i)
    for rec in recs:
        assert rec.done.wait(30)
    assert len({t for rec in recs for t in rec.tokens}) > 5
    for rec, prompt, p, n in zip(recs, prompts, params, lengths):
        assert rec.tokens == _sampled_alone(reference, prompt, p)
        assert rec.events[-1] == ("done", {"finish_reason": "length", "prompt_tokens": len(prompt),
                                           "completion_tokens": n})
    assert max(len(rows) for q, rows in engine.calls if q == 1) > 1  # decode steps were shared
    assert engine.running == 0 and engine.queue_depth == 0
    assert sorted(engine.rows.free) == list(range(6))  # every row went back


def test_a_cancelled_stream_frees_its_row_within_one_step(engine):
    rec, other = EventRecorder(), EventRecorder()
    job = Job([1, 2, 3], SamplingParams(temperature=0, max_tokens=500), rec.emit)
    engine.submit(job)
    engine.submit(Job([4, 5], SamplingParams(temperature=0, max_tokens=500), other.emit))
    while len(rec.tokens) < 5:
        time.sleep(0.001)
    row = next(rows[0] for q, rows in engine.calls if q == 3)
    engine.cancel(job)
    mark = len(engine.calls)
    while len(engine.calls) < mark + 3:
        time.sleep(0.001)
    # at most the step already running when cancel() arrived still carries the row; the next ones do not
    assert all(row not in rows for q, rows in engine.calls[mark + 1:mark + 3])
    assert row in engine.rows.free and engine.running == 1
    assert not rec.done.is_set()  # a cancelled job sends nothing more


def test_disconnect_over_http_frees_the_row(make_server):
    srv = make_server(max_batch=2)
    eng = srv.engine

    async def disconnect(stream):
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            body = {"prompt": "w1 w2", "max_tokens": 3000, "temperature": 0, "stream": stream}
            if stream:
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            break  # one token, then the client goes away
            else:
                task = asyncio.ensure_future(c.post("/v1/completions", json=body))
                while eng.running == 0:
                    await asyncio.sleep(0.005)
                await asyncio.sleep(0.05)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

    every_row = list(range(2 + 8))
    for stream in (True, False):
        asyncio.run(disconnect(stream))
        end = time.monotonic() + 10  # the engine thread ends the job, then frees its row: wait for both
        while (eng.running or sorted(eng.rows.free) != every_row) and time.monotonic() < end:
            time.sleep(0.01)
        assert eng.running == 0, f"stream={stream}: the row is still busy"
        assert sorted(eng.rows.free) == every_row  # every row of the pool is free again


def test_overload_gets_429_with_retry_after(make_server):
    srv = make_server(max_batch=1, max_queue=2)
    body = {"prompt": "w1", "max_tokens": 400, "temperature": 0}
    statuses = []
    # the five beyond the queue are refused while the first request's first step waits, so the overload happens
    # however fast the engine is next to the clients
    _hold_first_step(srv.engine, lambda: statuses.count(429) >= 5)

    def send(_):
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=120)
        statuses.append(r.status_code)
        return r

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(8)))
    refused = [r for r in results if r.status_code == 429]
    assert statuses.count(200) >= 3 and refused  # one running, two waiting; the rest refused
    assert refused[0].headers["Retry-After"] == "1"
    assert refused[0].json()["error"]["type"] == "rate_limit_error"
    assert httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
