"""The HTTP API as its users meet it: the real `openai` client (plain, streaming, logprobs, stop), raw server-sent
events through httpx, the models list, health and Prometheus metrics; with a seed, the server samples the tokens
`TxlRuntime.generate` samples."""

from __future__ import annotations

import json
import math
import threading
import time

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from txl_deploy.runtimes import SamplingParams, TxlRuntime
from txl_deploy.serving.http.app import ServeSettings
from txl_deploy.serving.http.scheduler import Scheduler
from txl_deploy.serving.http.server import BackgroundServer

PROMPT = "w1 w2 w3 w4"
# The tiny model's greedy continuation of any prompt is " w3" over and over, which a server that lost the prompt,
# the memory or a stop would give as well; sampled with a seed, every token depends on the model's distribution at
# its step, and the server must draw what TxlRuntime.generate draws.
SAMPLED = {"temperature": 1.0, "seed": 42}


def _want_text(reference, prompt, n, **sampling):
    rt = reference()
    ids = list(rt.generate(prompt, n, **sampling))
    return "".join(rt.vocab.piece(t) for t in ids), ids


def _pieces(reference, ids) -> list[str]:
    rt = reference()
    return [rt.vocab.piece(t) for t in ids]


def test_plain_completion_is_generate(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **SAMPLED)
    text, _ = _want_text(reference, PROMPT, 12, **SAMPLED)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and choice.index == 0
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 12, 16)


def test_prompt_as_token_ids_and_returned_ids(client, reference):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=12, **SAMPLED,
                                  extra_body={"return_token_ids": True})
    _, ids = _want_text(reference, [5, 6, 7], 12, **SAMPLED)
    assert r.choices[0].model_extra["token_ids"] == ids


def test_streaming_gives_the_same_text_in_chunks(client, reference):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, **SAMPLED, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want_text, want_ids = _want_text(reference, PROMPT, 12, **SAMPLED)
    assert text == want_text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    # a chunk per token, or one for the tokens that were waiting when the client is slower than the model
    ids = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert sum(ids, []) == want_ids and all(ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_logprobs_in_openais_shape_are_the_models(client, reference, alone):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    toks, lps = alone(PROMPT, 5)
    rt = reference()
    assert lp.tokens == [rt.vocab.piece(t) for t in toks]
    np.testing.assert_allclose(lp.token_logprobs, [float(p[t]) for p, t in zip(lps, toks)], rtol=0, atol=1e-5)
    for top, p in zip(lp.top_logprobs, lps):
        best = np.argsort(-p, kind="stable")[:3]
        assert list(top) == [rt.vocab.piece(int(i)) for i in best]
        np.testing.assert_allclose(list(top.values()), p[best], rtol=0, atol=1e-5)
    offsets = np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    assert lp.text_offset == offsets


def _stop_request(client, stream, extra_body=None, **request):
    """(text, token ids, finish reason, completion tokens) of one request, plain or streamed."""
    if stream:
        request["stream_options"] = {"include_usage": True}
    r = client.completions.create(model="tiny", prompt=PROMPT, stream=stream, **request,
                                  extra_body={**(extra_body or {}), "return_token_ids": True})
    if not stream:
        c = r.choices[0]
        return c.text, c.model_extra["token_ids"], c.finish_reason, r.usage.completion_tokens
    chunks = list(r)
    choices = [c.choices[0] for c in chunks if c.choices]
    ids = [t for c in choices for t in c.model_extra.get("token_ids") or []]
    return "".join(c.text for c in choices), ids, choices[-1].finish_reason, chunks[-1].usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(client, reference, stream):
    text, ids = _want_text(reference, PROMPT, 20, **SAMPLED)
    pieces = _pieces(reference, ids)
    ends = [len("".join(pieces[:k + 1])) for k in range(len(pieces))]
    # From the fourth token's last character into the sixth token: the text it begins with is held back until it
    # is known to be the stop string's, the sixth token's text after the match is dropped, and the request ends
    # at the token that completes the match.
    begin = ends[3] - 1
    stop = text[begin:ends[5] - 1]
    assert text.find(stop) == begin and len(pieces[3]) > 1 and len(pieces[5]) > 1  # nowhere earlier in the text
    want = (text[:begin], ids[:6], "stop", 6)
    assert _stop_request(client, stream, max_tokens=20, **SAMPLED, stop=["zzz", stop]) == want


def test_stop_token_ids_and_min_tokens(client, reference):
    _, free = _want_text(reference, PROMPT, 20, **SAMPLED)
    # a token the seeded run first meets after a few others
    first = next(k for k, t in enumerate(free) if k >= 3 and t not in free[:k])
    stop_id = free[first]
    rt = reference()
    extra = {"stop_token_ids": [stop_id]}
    want = list(reference().generate(PROMPT, params=SamplingParams(max_tokens=20, **SAMPLED, **extra)))
    assert want == free[:first + 1]  # generate ends at the stop token too
    for stream in (False, True):
        got = _stop_request(client, stream, max_tokens=20, **SAMPLED, extra_body=extra)
        # the stop token is sent as an id, not as text
        assert got == ("".join(rt.vocab.piece(t) for t in want[:-1]), want, "stop", len(want)), stream
    # min_tokens: the stop token cannot end the completion before that many tokens; TxlRuntime.generate with the
    # same SamplingParams is what the server must give
    # (the first token of the seeded run that, held off for two more tokens, is then drawn within 20)
    for stop_id in dict.fromkeys(free[3:]):
        least = free.index(stop_id) + 2
        extra = {"stop_token_ids": [stop_id], "min_tokens": least}
        want = list(reference().generate(PROMPT, params=SamplingParams(max_tokens=20, **SAMPLED, **extra)))
        if want[-1] == stop_id and len(want) < 20:
            break
    assert stop_id not in want[:least] and want[-1] == stop_id and len(want) < 20  # held off, then it stopped
    for stream in (False, True):
        got = _stop_request(client, stream, max_tokens=20, **SAMPLED, extra_body=extra)
        assert got == ("".join(rt.vocab.piece(t) for t in want[:-1]), want, "stop", len(want)), stream


def test_seeded_sampling_equals_generate_with_every_control(client, reference):
    controls = dict(temperature=0.9, top_p=0.9, seed=1234, presence_penalty=0.4, frequency_penalty=0.3)
    extra = dict(top_k=30, min_p=0.02, repetition_penalty=1.3, no_repeat_ngram_size=3, logit_bias={"7": -100.0})
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=25, **controls,
                                  extra_body={**extra, "return_token_ids": True})
    rt = reference()
    params = SamplingParams(max_tokens=25, **controls, **{**extra, "logit_bias": {7: -100.0}})
    want = list(rt.generate(PROMPT, params=params))
    assert r.choices[0].model_extra["token_ids"] == want
    assert 7 not in want
    # and a different seed samples something else
    r2 = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=25, **{**controls, "seed": 99},
                                   extra_body={"return_token_ids": True})
    assert r2.choices[0].model_extra["token_ids"] != want


def test_raw_server_sent_events(server, reference):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, **SAMPLED, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert all(line.startswith("data: ") or line.startswith(":") for line in lines)
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == _want_text(reference, PROMPT, 6, **SAMPLED)[0]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def _metrics(server) -> dict:
    """Every sample of /metrics: {(sample name, sorted labels): value}, creation times left out."""
    text = httpx.get(server.url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if not s.name.endswith("_created")}


def _made(before: dict, after: dict) -> dict:
    """The samples that changed, and by how much (a series new since `before` counts from 0)."""
    def same(a, b):
        return a == b or (math.isnan(a) and math.isnan(b))

    return {k: v - before.get(k, 0.0) for k, v in after.items() if not same(v, before.get(k, 0.0))}


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "txl-deploy"
    assert models.data[0].model_extra["session_memory_bytes"] > 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    before = _metrics(server)
    names = {name for name, _ in before}
    for name in ("txl_requests_total", "txl_prompt_tokens_total", "txl_generated_tokens_total",
                 "txl_time_to_first_token_seconds_count", "txl_inter_token_latency_seconds_count",
                 "txl_batch_size_count", "txl_queue_depth", "txl_running_streams", "txl_sessions",
                 "txl_session_bytes"):
        assert name in names, name
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    ok = ("txl_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    end = time.monotonic() + 10
    while (after := _metrics(server)).get(ok, 0.0) == before.get(ok, 0.0):  # counted once the answer is sent
        assert time.monotonic() < end
        time.sleep(0.02)
    made = {k: v for k, v in _made(before, after).items() if dict(k[1]).get("endpoint") != "/metrics"}  # scrapes
    sums = {name: made.pop((name, ())) for name, _ in list(made) if name.endswith("_sum")}
    for name, labels in list(made):  # the finite buckets depend on timing; +Inf holds every observation
        if name.endswith("_bucket") and dict(labels)["le"] != "+Inf":
            assert 0 <= made.pop((name, labels)) <= made.get((name, (("le", "+Inf"),)), 0.0)
    generated = [k for k in after if k[0] == "txl_generated_tokens_total"]
    # by finish reason where the server labels them so
    ended = (("finish_reason", "length"),) if any(labels for _, labels in generated) else ()
    inf = (("le", "+Inf"),)
    assert made == {
        ok: 1.0,
        ("txl_prompt_tokens_total", ()): 4.0,
        ("txl_generated_tokens_total", ended): 3.0,
        ("txl_time_to_first_token_seconds_count", ()): 1.0, ("txl_time_to_first_token_seconds_bucket", inf): 1.0,
        ("txl_inter_token_latency_seconds_count", ()): 2.0, ("txl_inter_token_latency_seconds_bucket", inf): 2.0,
        # a request alone: the decode calls that fed its first two tokens, one stream each
        ("txl_batch_size_count", ()): 2.0, ("txl_batch_size_bucket", inf): 2.0,
    }
    assert sums["txl_batch_size_sum"] == 2.0
    assert sums["txl_time_to_first_token_seconds_sum"] > 0 and sums["txl_inter_token_latency_seconds_sum"] > 0


def test_health_is_503_until_the_model_is_loaded(tiny_onnx):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return Scheduler(TxlRuntime.load(tiny_onnx), max_batch=2, max_sessions=2)

    srv = BackgroundServer(slow_load, ServeSettings(model_name="tiny")).launch()
    try:
        for _ in range(400):
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "w1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        release.set()
        srv.start()  # waits for /health 200
        assert httpx.get(srv.url + "/health").status_code == 200
    finally:
        release.set()
        srv.stop()


@pytest.mark.parametrize("api_key", ["s3cret"])
def test_api_key_guards_v1_only(make_server, api_key):
    openai = pytest.importorskip("openai")
    srv = make_server(settings={"api_key": api_key})
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "w1", "max_tokens": 1})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    assert httpx.get(srv.url + "/health").status_code == 200  # probes need no key
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=api_key, max_retries=0) as c:
        assert c.completions.create(model="tiny", prompt="w1", max_tokens=2, temperature=0).usage.completion_tokens == 2
