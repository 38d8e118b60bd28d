"""The Prometheus metrics stay bounded and say what happened: endpoint labels are route templates (one label for
every unknown path, however many a client makes up); the generated-token counters equal what the clients received,
by how each request ended, a client that went away mid-stream included; latencies are when the engine made the
tokens, not when the HTTP side read them."""

from __future__ import annotations

import collections
import json
import time

import httpx
from helpers.engine_gate import EngineGate
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "w1 w2 w3 w4"
KEY = "k-metrics"
ROUTES = {"/v1/completions", "/v1/models", "/v1/sessions", "/v1/sessions/{session_id}",
          "/v1/sessions/{session_id}/park", "/v1/sessions/{session_id}/restore", "/health", "/metrics"}


def _scrape(srv) -> dict:
    """{(sample name, sorted labels): value} of GET /metrics."""
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    return _value(after, name, **labels) - _value(before, name, **labels)


def _wait_for(condition, what: str, timeout: float = 30.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _stream_ids(srv, body: dict) -> tuple[list[int], str | None, dict | None]:
    """A streamed completion's token ids (return_token_ids), its finish_reason and its usage chunk."""
    ids, finish, usage = [], None, None
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True, "return_token_ids": True},
                      timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                usage = event["usage"]
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
                finish = choice["finish_reason"] or finish
    return ids, finish, usage


def test_endpoint_labels_are_route_templates_and_one_label_for_unknown_paths(make_server):
    srv = make_server(settings={"api_key": KEY})
    auth = {"Authorization": f"Bearer {KEY}"}
    for i in range(20):  # without the key: refused, and none of them makes a label of its own
        assert httpx.post(f"{srv.url}/v1/sessions/s{i}/junk{i}").status_code == 401
        assert httpx.get(f"{srv.url}/v1/made-up-{i}").status_code == 401
        assert httpx.get(f"{srv.url}/made-up/{i}").status_code == 404
        assert httpx.get(f"{srv.url}/v1/sessions/nobody-{i}", headers=auth).status_code == 404
    assert httpx.post(f"{srv.url}/v1/sessions", json={"id": "s1"}, headers=auth).status_code == 201
    assert httpx.post(f"{srv.url}/v1/sessions/s1/park", headers=auth).status_code == 400  # nothing fed yet
    assert httpx.put(f"{srv.url}/v1/sessions/s1", headers=auth).status_code == 405
    assert httpx.delete(f"{srv.url}/v1/sessions/s1", headers=auth).status_code == 200

    samples = _scrape(srv)
    counted = {dict(labels)["endpoint"]: 0 for name, labels in samples if name == "txl_requests_total"}
    assert set(counted) <= ROUTES | {"unmatched"}, sorted(counted)
    assert _value(samples, "txl_requests_total", endpoint="unmatched", status="401") == 40
    assert _value(samples, "txl_requests_total", endpoint="unmatched", status="404") == 20
    assert _value(samples, "txl_requests_total", endpoint="/v1/sessions/{session_id}", status="404") == 20
    assert _value(samples, "txl_requests_total", endpoint="/v1/sessions/{session_id}", status="405") == 1
    assert _value(samples, "txl_requests_total", endpoint="/v1/sessions/{session_id}", status="200") == 1
    assert _value(samples, "txl_requests_total", endpoint="/v1/sessions/{session_id}/park", status="400") == 1
    assert _value(samples, "txl_requests_total", endpoint="/v1/sessions", status="201") == 1


def test_generated_tokens_equal_what_the_clients_received_by_how_each_ended(server):
    before = _scrape(server)
    received = collections.Counter()

    # seeded sampling, so the tokens differ and a stop token id can end the stream after a few of them
    sampled = {"prompt": PROMPT, "max_tokens": 10, "temperature": 1.0, "seed": 4}
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={**sampled, "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 10
    received["length"] += len(choice["token_ids"])

    first = choice["token_ids"]
    at = next(j for j in range(2, len(first)) if first[j] not in first[:j])  # a token first written there
    ids, finish, usage = _stream_ids(server, {**sampled, "stop_token_ids": [first[at]],
                                              "stream_options": {"include_usage": True}})
    assert finish == "stop" and ids == first[:at + 1] and usage["completion_tokens"] == len(ids)
    received["stop"] += len(ids)

    # A client that reads 3 tokens and goes away: the engine is held before it can make a 4th, until the server
    # has seen the disconnect, so 3 is every token the engine made for it.
    with EngineGate(server.engine, which=3, decode_only=True) as gate:
        ids = []
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 50, "temperature": 0, "stream": True, "return_token_ids": True}) as r:
            # Held in a name: a `break` out of an unnamed iter_lines() finalizes it at once, which closes the
            # connection then, racing the engine to the gate; the response closes only when the block is left.
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    ids += json.loads(line.removeprefix("data: "))["choices"][0].get("token_ids") or []
                if len(ids) >= 3:
                    break
            # The engine reaches the gate just after sending the 3rd token. The client goes away only once it is
            # held there: a disconnect that reached the engine first would end the stream before that call.
            assert gate.held.wait(30)
        assert len(ids) == 3
        received["cancelled"] += 3
        _wait_for(lambda: _delta(before, _scrape(server), "txl_generated_tokens_total",
                                 finish_reason="cancelled") == 3, "the cancelled stream's tokens to be counted")
    _wait_for(lambda: server.engine.running == 0, "the engine to let the cancelled stream go")

    after = _scrape(server)
    for reason in ("length", "stop", "cancelled", "error"):
        assert _delta(before, after, "txl_generated_tokens_total", finish_reason=reason) == received[reason], reason
    assert _delta(before, after, "txl_requests_total", endpoint="/v1/completions", status="200") == 3
    # one first token per request, and one gap between each two tokens of a request
    assert _delta(before, after, "txl_time_to_first_token_seconds_count") == 3
    assert _delta(before, after, "txl_inter_token_latency_seconds_count") == sum(received.values()) - 3


def test_latencies_are_when_the_engine_made_the_tokens(server):
    """Each engine call takes 40 ms, and the HTTP side hears of the tokens only at the end, all at once: the
    latencies are still the engine's 40 ms, not the near-zero gaps between reads."""
    step, n = 0.04, 6
    engine = server.engine
    run, submit = engine.rows.run, engine.submit

    def slow_call(*args, **kwargs):
        time.sleep(step)
        return run(*args, **kwargs)

    def submit_told_at_the_end(job):
        emit, held = job.emit, []

        def at_the_end(kind, payload):
            held.append((kind, payload))
            if kind != "token":
                for event in held:
                    emit(*event)
        job.emit = at_the_end
        submit(job)

    before = _scrape(server)
    engine.rows.run, engine.submit = slow_call, submit_told_at_the_end
    try:
        sent = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"prompt": PROMPT, "max_tokens": n, "temperature": 0})
        elapsed = time.monotonic() - sent
    finally:
        engine.rows.run = run
        del engine.submit
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == n
    after = _scrape(server)
    assert _delta(before, after, "txl_inter_token_latency_seconds_count") == n - 1
    assert _delta(before, after, "txl_inter_token_latency_seconds_bucket", le="0.025") == 0  # none below 25 ms
    assert _delta(before, after, "txl_inter_token_latency_seconds_sum") >= (n - 1) * step
    assert _delta(before, after, "txl_time_to_first_token_seconds_count") == 1
    assert _delta(before, after, "txl_time_to_first_token_seconds_bucket", le="0.025") == 0
    # the first token came out n - 1 engine calls before the last one, so that long before the response
    assert _delta(before, after, "txl_time_to_first_token_seconds_sum") <= elapsed - (n - 1) * step
