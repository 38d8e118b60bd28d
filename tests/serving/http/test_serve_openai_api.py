"""The HTTP API as its users meet it: the real `openai` client (plain, streaming, logprobs, stop), raw server-sent
events through httpx, the models list, health and Prometheus metrics; with a seed, the server samples the tokens
`TxlRuntime.generate` samples."""

from __future__ import annotations

import json
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


def _want_text(reference, prompt, n, **sampling):
    rt = reference()
    ids = list(rt.generate(prompt, n, **sampling))
    return "".join(rt.vocab.piece(t) for t in ids), ids


def test_plain_completion_is_greedy_generate(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    text, ids = _want_text(reference, PROMPT, 12, temperature=0)
    choice = r.choices[0]
    assert choice.text == text and choice.finish_reason == "length" and choice.index == 0
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (4, 12, 16)


def test_prompt_as_token_ids_and_returned_ids(client, reference):
    r = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0,
                                  extra_body={"return_token_ids": True})
    _, ids = _want_text(reference, [5, 6, 7], 6, temperature=0)
    assert r.choices[0].model_extra["token_ids"] == ids


def test_streaming_gives_the_same_text_in_chunks(client, reference):
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"return_token_ids": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want_text, want_ids = _want_text(reference, PROMPT, 12, temperature=0)
    assert text == want_text
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    # a chunk per token, or one for the tokens that were waiting when the client is slower than the model
    ids = [c.choices[0].model_extra["token_ids"] for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert sum(ids, []) == want_ids and all(ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_logprobs_in_openais_shape_are_the_models(client, reference):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    toks, lps = _greedy_with_log_probs(reference, PROMPT, 5)
    rt = reference()
    assert lp.tokens == [rt.vocab.piece(t) for t in toks]
    np.testing.assert_allclose(lp.token_logprobs, [float(p[t]) for p, t in zip(lps, toks)], rtol=0, atol=1e-5)
    for top, p in zip(lp.top_logprobs, lps):
        best = np.argsort(-p, kind="stable")[:3]
        assert list(top) == [rt.vocab.piece(int(i)) for i in best]
        np.testing.assert_allclose(list(top.values()), p[best], rtol=0, atol=1e-5)
    offsets = np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]).tolist()
    assert lp.text_offset == offsets


def _greedy_with_log_probs(reference, prompt, n):
    rt = reference()
    lp = rt.prefill(rt.encode(prompt)[None])[0]
    toks, lps = [], []
    for _ in range(n):
        lps.append(lp)
        toks.append(int(np.argmax(lp)))
        lp = rt.prefill(np.array([[toks[-1]]]))[0]
    return toks, lps


def test_stop_string_ends_the_text_before_it(client, reference):
    text, _ = _want_text(reference, PROMPT, 20, temperature=0)
    words = text.split()
    stop = " " + words[3]  # the fourth generated word, with its space: a match across the token boundary
    want = text[:text.index(stop)]
    for stream in (False, True):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop, "zzz"],
                                      stream=stream)
        if stream:
            chunks = list(r)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert got == want and reason == "stop", (stream, got, want)


def test_stop_token_ids_and_min_tokens(client, reference):
    _, ids = _want_text(reference, PROMPT, 20, temperature=0)
    stop_id = ids[2]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "return_token_ids": True})
    first = ids.index(stop_id)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["token_ids"] == ids[:first + 1]
    rt = reference()
    assert r.choices[0].text == "".join(rt.vocab.piece(t) for t in ids[:first])  # the stop token is not text
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id], "min_tokens": first + 1,
                                              "return_token_ids": True})
    assert stop_id not in r.choices[0].model_extra["token_ids"][:first + 1]


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
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert all(line.startswith("data: ") or line.startswith(":") for line in lines)
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events) == _want_text(reference, PROMPT, 6, temperature=0)[0]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].owned_by == "txl-deploy"
    assert models.data[0].model_extra["session_memory_bytes"] > 0
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("txl_requests", "txl_prompt_tokens", "txl_generated_tokens", "txl_time_to_first_token_seconds",
                 "txl_inter_token_latency_seconds", "txl_batch_size", "txl_queue_depth", "txl_running_streams",
                 "txl_sessions", "txl_session_bytes"):
        assert name in families, name
    ok = [s for s in families["txl_requests"].samples
          if s.labels.get("endpoint") == "/v1/completions" and s.labels.get("status") == "200"]
    assert ok and ok[0].value >= 1
    generated = [s for s in families["txl_generated_tokens"].samples if s.name == "txl_generated_tokens_total"]
    assert generated[0].value >= 3
    ttft = [s for s in families["txl_time_to_first_token_seconds"].samples if s.name.endswith("_count")]
    assert ttft[0].value >= 1


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
