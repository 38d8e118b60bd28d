"""`txl-deploy serve --triton`: the same API, served through Triton servers (the bundled tritonserver on loopback,
two of them): completions equal the local server's and TxlRuntime's, sessions stay on one server and continue
exactly, park and restore go through the Triton model's parked states; a restore raced by a delete or a request
leaves no conversation open for a session that is gone, and a fleet whose own bookkeeping fails stops and says so.
`serve --triton --lazy` decodes from the head and the tails each decision needs: the non-lazy fleet's answers, with
the full graph never run."""

from __future__ import annotations

import functools
import json
import re
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers import conversations

pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")

from txl_deploy.runtimes import SamplingParams, TxlRuntime  # noqa: E402
from txl_deploy.serving.http.app import ServeSettings  # noqa: E402
from txl_deploy.serving.http.fleet import FleetEngine, sequence_id  # noqa: E402
from txl_deploy.serving.http.protocol import ApiError  # noqa: E402
from txl_deploy.serving.http.scheduler import Job  # noqa: E402
from txl_deploy.serving.http.server import BackgroundServer  # noqa: E402
from txl_deploy.serving.ports import free_port  # noqa: E402
from txl_deploy.serving.triton.client import rendezvous_order  # noqa: E402
from txl_deploy.serving.triton.repository import write_repository  # noqa: E402

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # longer than one request (16 tokens)


@pytest.fixture(scope="module")
def tritons(tritonserver, tiny_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer

    repo = write_repository(tiny_onnx, tmp_path_factory.mktemp("fleet") / "repo", backend="python", max_batch=4,
                            max_sequences=16, idle_timeout=120, threads=1)
    ports = [free_port() for _ in range(2)]
    # the model's custom metrics (rows each graph ran for) on a metrics port each
    started = [TritonServer(repo, extra_args=["--allow-metrics=true", "--allow-gpu-metrics=false",
                                              "--allow-cpu-metrics=false", f"--metrics-port={port}"])
               for port in ports]
    for srv, port in zip(started, ports):
        srv.metrics_url = f"http://127.0.0.1:{port}/metrics"
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda s: s.start(), started))
        yield started
    finally:
        for srv in started:
            srv.__exit__(None, None, None)


@pytest.fixture(scope="module")
def fleet(tritons):
    urls = [s.grpc_url for s in tritons]
    load = functools.partial(FleetEngine.connect, urls, model="txl", max_batch=4, max_sessions=4, max_queue=16)
    with BackgroundServer(load, ServeSettings(model_name="txl")) as srv:
        yield srv


def _complete(srv, prompt, n, **extra):
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "return_token_ids": True, "logprobs": 5, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _reference(tiny_onnx, segments):
    return conversations.greedy_segments(TxlRuntime.load(tiny_onnx), segments)[0]


def test_completions_through_the_fleet_equal_the_runtime(fleet, tiny_onnx):
    choice = _complete(fleet, PROMPT, 8)
    (toks, lps), = _reference(tiny_onnx, [(PROMPT, 8)])
    assert choice["token_ids"] == toks and choice["finish_reason"] == "length"
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], [lp[t] for lp, t in zip(lps, toks)], atol=1e-5)
    # streaming and a seeded sample with every control, as generate() samples it
    controls = dict(temperature=0.8, top_p=0.95, seed=5, top_k=40, repetition_penalty=1.2, presence_penalty=0.3)
    r = httpx.post(fleet.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 12, "stream": True, "return_token_ids": True, **controls})
    ids = []
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
    want = list(TxlRuntime.load(tiny_onnx).generate(PROMPT, params=SamplingParams(max_tokens=12, **controls)))
    assert ids == want


def test_a_session_stays_on_one_server_and_continues_exactly(fleet, tritons, tiny_onnx):
    r = httpx.post(fleet.url + "/v1/sessions", json={"id": "fleet-chat"})
    assert r.status_code == 201 and r.json()["memory_bytes"] is None
    got = [_complete(fleet, prompt, n, session_id="fleet-chat") for prompt, n in ((PROMPT, 5), ([7, 7, 2], 4), ("", 3))]
    want = _reference(tiny_onnx, [(PROMPT, 5), ([7, 7, 2], 4), ([], 3)])
    for choice, (toks, lps) in zip(got, want):
        assert choice["token_ids"] == toks
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], [lp[t] for lp, t in zip(lps, toks)],
                                   atol=1e-5)
    conv = fleet.engine.sessions.get("fleet-chat").handle
    urls = list(conv.client.servers)
    assert conv.id == sequence_id("fleet-chat") and conv.url == rendezvous_order(conv.id, urls)[0]
    # park, then restore under another id: it goes on exactly
    parked = httpx.post(fleet.url + "/v1/sessions/fleet-chat/park")
    assert parked.status_code == 200 and len(parked.content) > 1000, parked.text
    r = httpx.post(fleet.url + "/v1/sessions/fleet-chat-2/restore", content=parked.content)
    assert r.status_code == 201, r.text
    more = _complete(fleet, [4, 4], 3, session_id="fleet-chat-2")
    toks, _ = _reference(tiny_onnx, [(PROMPT, 5), ([7, 7, 2], 4), ([], 3), ([4, 4], 3)])[-1]
    assert more["token_ids"] == toks
    bad = httpx.post(fleet.url + "/v1/sessions/x/restore", content=b"garbage")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_state"
    gone = httpx.post(fleet.url + "/v1/completions", json={"prompt": [1], "session_id": "fleet-chat"})
    assert gone.status_code == 404 and "was parked" in gone.json()["error"]["message"]


def test_concurrent_requests_through_the_fleet(fleet, tiny_onnx):
    # seeded sampling: each request's tokens are its own (greedy, the tiny random model writes one token
    # everywhere), so answers mixed up between requests or rows would differ from TxlRuntime's
    prompts = [[i % 58, (3 * i) % 58, (7 * i + 1) % 58] for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: _complete(fleet, prompts[i], 6, temperature=1.0, seed=i)["token_ids"],
                            range(8)))
    rt = TxlRuntime.load(tiny_onnx)
    for i, (prompt, ids) in enumerate(zip(prompts, got)):
        rt.reset()
        assert ids == list(rt.generate(prompt, params=SamplingParams(max_tokens=6, temperature=1.0, seed=i)))
    assert len({tuple(ids) for ids in got}) == len(prompts)


def test_http_addresses_are_refused_with_the_reason():
    from txl_deploy.errors import InputError

    with pytest.raises(InputError, match="needs the servers' gRPC addresses"):
        FleetEngine(["http://127.0.0.1:8000"])


def test_the_triton_client_and_serve_client_sample_as_generate_does(tritons, tiny_onnx):
    """The other paths to Triton use the same sampler: TxlTritonClient's conversations and `serve-client`."""
    from click.testing import CliRunner

    from txl_deploy.cli import main
    from txl_deploy.errors import InputError
    from txl_deploy.serving.triton.client import TxlTritonClient

    controls = dict(temperature=0.9, top_k=30, top_p=0.9, min_p=0.01, repetition_penalty=1.3, frequency_penalty=0.5,
                    no_repeat_ngram_size=2, seed=11)
    want = list(TxlRuntime.load(tiny_onnx).generate(PROMPT, 15, **controls))
    client = TxlTritonClient(tritons[0].grpc_url)
    try:
        assert list(client.generate(PROMPT, max_new_tokens=15, **controls)) == want
        with pytest.raises(InputError, match="does not support stop"):
            list(client.generate(PROMPT, params=SamplingParams(stop=["w1"])))
    finally:
        client.close()
    rt = TxlRuntime.load(tiny_onnx)
    prompt = " ".join(rt.vocab.symbols[t] for t in PROMPT)
    want = rt.decode(list(rt.generate(prompt, 15, **controls)))
    args = ["--temperature", "0.9", "--top-k", "30", "--top-p", "0.9", "--min-p", "0.01", "--repetition-penalty",
            "1.3", "--frequency-penalty", "0.5", "--no-repeat-ngram-size", "2", "--seed", "11"]
    result = CliRunner().invoke(main, ["serve-client", tritons[1].grpc_url, "--prompt", prompt,
                                       "--max-new-tokens", "15", *args])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == want.strip()
    bad = CliRunner().invoke(main, ["serve-client", tritons[1].grpc_url, "--prompt", prompt, "--top-p", "2"])
    assert bad.exit_code == 2 and "top_p must be in (0, 1]" in bad.output


def test_restores_racing_deletes_and_requests_leave_no_conversation_open(fleet, tiny_onnx):
    """A session being restored is refused to a DELETE or a request (409) until its conversation is resumed, so
    no conversation is resumed for a session that is gone; every one left open belongs to a live session."""
    engine = fleet.engine
    assert httpx.post(fleet.url + "/v1/sessions", json={"id": "race-seed"}).status_code == 201
    _complete(fleet, PROMPT, 3, session_id="race-seed")
    blob = httpx.post(fleet.url + "/v1/sessions/race-seed/park").content
    ids = [f"race-{i}" for i in range(16)]

    def race(sid):
        with ThreadPoolExecutor(2) as pool:
            restoring = pool.submit(httpx.post, f"{fleet.url}/v1/sessions/{sid}/restore", content=blob, timeout=120)
            if int(sid.split("-")[1]) % 2:
                other = pool.submit(httpx.delete, f"{fleet.url}/v1/sessions/{sid}", timeout=120)
            else:
                other = pool.submit(httpx.post, fleet.url + "/v1/completions", timeout=120, json={
                    "prompt": [4, 4], "max_tokens": 2, "temperature": 0, "session_id": sid})
            r, o = restoring.result(), other.result()
        assert r.status_code in (201, 429), r.text
        assert o.status_code in (200, 404, 409), o.text
        if o.status_code == 409:
            assert o.json()["error"]["code"] == "session_busy"
        return r.status_code, o.status_code

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(race, ids))
    assert any(r == 201 for r, _ in results)
    # the restored sessions that are left go on exactly where the parked one was
    live = [sid for sid in ids if httpx.get(f"{fleet.url}/v1/sessions/{sid}").status_code == 200]
    want, = _reference(tiny_onnx, [(PROMPT, 3), ([7], 2)])[1:]
    for sid in live:
        info = httpx.get(f"{fleet.url}/v1/sessions/{sid}").json()
        if info["tokens"] == len(PROMPT) + 3:  # not continued by its racing request
            assert _complete(fleet, [7], 2, session_id=sid)["token_ids"] == want[0]
    for sid in live:
        assert httpx.delete(f"{fleet.url}/v1/sessions/{sid}").status_code == 200
    for future in list(engine._closing.values()):
        future.result(60)
    open_ids = set(engine.client._conversations)
    assert not open_ids & {sequence_id(sid) for sid in ids + ["race-seed"]}, "a conversation of a gone session"


def test_a_fleet_whose_bookkeeping_fails_stops_and_says_so(tritons, monkeypatch):
    """An error outside any one request's handling (here: releasing a session) stops the fleet engine: that request
    hears a 500, the ones queued behind it and every new one a 503, and `on_failure` tells the server to exit."""
    engine = FleetEngine.connect([s.grpc_url for s in tritons], model="txl", max_batch=1, max_sessions=2,
                                 max_queue=4)
    stopped, heard = [], {}
    done = {name: threading.Event() for name in ("first", "queued")}
    engine.on_failure = stopped.append

    def recorder(name):
        def emit(kind, payload):
            if kind != "token" and name not in heard:
                heard[name] = payload
                done[name].set()
        return emit

    def broken(session):
        raise RuntimeError("injected fault in the bookkeeping")

    try:
        engine.create_session("s")
        monkeypatch.setattr(engine.sessions, "release", broken)
        engine.submit(Job(PROMPT, SamplingParams(temperature=0, max_tokens=3), recorder("first"), session_id="s"))
        try:
            engine.submit(Job([1, 2], SamplingParams(max_tokens=2), recorder("queued")))
        except ApiError as e:  # the first one had failed already
            heard["queued"] = e
            done["queued"].set()
        assert done["first"].wait(120) and done["queued"].wait(120)
        assert heard["first"].status == 500 and heard["queued"].status == 503
        assert heard["queued"].code == "engine_failed"
        assert not engine.alive and isinstance(engine.failure, RuntimeError) and stopped == [engine.failure]
        with pytest.raises(ApiError) as e:
            engine.submit(Job([1], SamplingParams(max_tokens=1), recorder("later")))
        assert e.value.status == 503
    finally:
        monkeypatch.undo()
        engine.stop(10)


@pytest.fixture(scope="module")
def lazy_fleet(tritons):
    urls = [s.grpc_url for s in tritons]
    load = functools.partial(FleetEngine.connect, urls, model="txl", max_batch=4, max_sessions=4, max_queue=16,
                             lazy=True)
    with BackgroundServer(load, ServeSettings(model_name="txl")) as srv:
        yield srv


def _graph_runs(tritons) -> dict:
    """Rows the Triton model ran through each graph ("full", "head") and each tail cluster (1, 2), summed over the
    servers."""
    out = {}
    for srv in tritons:
        with urllib.request.urlopen(srv.metrics_url, timeout=10) as r:
            text = r.read().decode()
        for labels, value in re.findall(r"^txl_deploy_\w+\{([^}]*)\} (\S+)$", text, re.MULTILINE):
            key = dict(re.findall(r'(\w+)="([^"]*)"', labels))
            key = key.get("graph") or int(key["cluster"])
            out[key] = out.get(key, 0) + int(float(value))
    return out


def _same_answer(lazy, full):
    """Lazy and full answers agree: the text, tokens, finish reason and offsets exactly; the log-probs (the parts'
    numbers against the full graph's) within float32 rounding, with the same top tokens."""
    assert lazy["token_ids"] == full["token_ids"]
    assert lazy["text"] == full["text"] and lazy["finish_reason"] == full["finish_reason"]
    a, b = lazy["logprobs"], full["logprobs"]
    assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
    np.testing.assert_allclose(a["token_logprobs"], b["token_logprobs"], atol=1e-5)
    for mine, theirs in zip(a["top_logprobs"], b["top_logprobs"]):
        assert list(mine) == list(theirs)
        np.testing.assert_allclose(list(mine.values()), list(theirs.values()), atol=1e-5)


LAZY_CONTROLS = [dict(temperature=0), dict(temperature=1.0, seed=3), dict(temperature=1.0, top_k=8, seed=5)]


def test_the_lazy_fleet_answers_as_the_full_one_without_running_the_full_graph(lazy_fleet, fleet, tritons,
                                                                                tiny_onnx):
    assert lazy_fleet.engine.lazy and not fleet.engine.lazy
    sessions = [(PROMPT, 5), ("", 4), ([7, 7, 2], 3)]  # a session continued without a prompt, then with one

    def run(srv, prefix, stop=None):
        answers = [_complete(srv, PROMPT, 12, **controls) for controls in LAZY_CONTROLS]
        if stop is None:  # a stop string: a piece of the greedy text after its first few tokens
            text, offsets = answers[0]["text"], answers[0]["logprobs"]["text_offset"]
            piece = text[offsets[min(4, len(offsets) - 1)]:][:3]
            stop = piece.strip() or piece
        answers += [_complete(srv, PROMPT, 12, stop=[stop], **controls) for controls in LAZY_CONTROLS[:2]]
        for i, controls in enumerate(LAZY_CONTROLS):
            sid = f"{prefix}-{i}"
            assert httpx.post(srv.url + "/v1/sessions", json={"id": sid}).status_code == 201
            answers += [_complete(srv, prompt, n, session_id=sid, **controls) for prompt, n in sessions]
        return answers, stop

    before = _graph_runs(tritons)
    lazy, stop = run(lazy_fleet, "lazy-chat")
    after = _graph_runs(tritons)
    full, _ = run(fleet, "full-chat", stop)
    for mine, theirs in zip(lazy, full, strict=True):
        _same_answer(mine, theirs)
    assert lazy[3]["finish_reason"] == "stop" and len(lazy[3]["token_ids"]) < 12, stop  # greedy: it stops
    # the seeded ones are generate's too
    for controls, answer in zip(LAZY_CONTROLS[1:], lazy[1:3]):
        params = SamplingParams(max_tokens=12, **controls)
        assert answer["token_ids"] == list(TxlRuntime.load(tiny_onnx).generate(PROMPT, params=params))
    # the servers ran the head graph for every token fed, never the full one, and a tail only sometimes
    tokens = sum(len(a["token_ids"]) for a in lazy)
    assert after["full"] == before["full"]
    assert after["head"] - before["head"] >= tokens
    assert 0 < (after[1] - before[1]) + (after[2] - before[2]) < 2 * tokens
    for srv, prefix in ((lazy_fleet, "lazy-chat"), (fleet, "full-chat")):
        for i in range(len(LAZY_CONTROLS)):
            assert httpx.delete(f"{srv.url}/v1/sessions/{prefix}-{i}").status_code == 200


def test_echo_through_either_fleet_scores_the_prompt_as_score_does(fleet, lazy_fleet, tiny_onnx):
    """echo with logprobs, through the fleet and the lazy one: the prompt's log-probs are TxlRuntime.score's (the
    first null) and the completion is the one without echo; a session's prompt is scored in its context (lazily:
    on the distribution composed from its head and tails) and the session goes on from it."""
    rt = TxlRuntime.load(tiny_onnx)
    second = [7, 7, 2, 9]
    for srv, sid in ((fleet, "echo-full"), (lazy_fleet, "echo-lazy")):
        choice = _complete(srv, PROMPT, 4, echo=True)
        rt.reset()
        assert choice["logprobs"]["token_logprobs"][0] is None
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:len(PROMPT)],
                                   -rt.score(np.array([PROMPT]))[0], atol=1e-5)
        assert choice["token_ids"] == _complete(srv, PROMPT, 4)["token_ids"]
        assert httpx.post(srv.url + "/v1/sessions", json={"id": sid}).status_code == 201
        context = PROMPT + _complete(srv, PROMPT, 3, session_id=sid)["token_ids"]
        scored = _complete(srv, second, 0, echo=True, session_id=sid)
        assert scored["finish_reason"] == "length" and scored["token_ids"] == []
        rt.reset()
        np.testing.assert_allclose(scored["logprobs"]["token_logprobs"],
                                   -rt.score(np.array([context + second]))[0][-len(second):], atol=1e-5)
        after = _complete(srv, "", 3, session_id=sid)["token_ids"]
        rt.reset()
        assert after == list(rt.generate(context + second, max_new_tokens=3, temperature=0.0))
        assert httpx.delete(f"{srv.url}/v1/sessions/{sid}").status_code == 200


def test_lazy_over_a_model_without_an_adaptive_softmax_decodes_the_full_distribution(tritons, monkeypatch, caplog):
    """A model that publishes no cutoffs has no head to decode from: --lazy changes nothing, and the log says so."""
    import logging

    from txl_deploy.serving.triton.client import TxlTritonClient
    from txl_deploy.serving.triton.protocol import CUTOFFS_PARAM

    params = TxlTritonClient._model_params
    monkeypatch.setattr(TxlTritonClient, "_model_params",
                        lambda self, server: {k: v for k, v in params(self, server).items() if k != CUTOFFS_PARAM})
    with caplog.at_level(logging.INFO, logger="txl_deploy.serving.http.fleet"):
        engine = FleetEngine.connect([s.grpc_url for s in tritons], model="txl", max_batch=1, lazy=True)
    try:
        assert not engine.lazy and not engine.client.lazy
        assert any("every step asks for the full distribution" in r.getMessage() for r in caplog.records)
        assert not any("decoding lazily" in r.getMessage() for r in caplog.records)
    finally:
        engine.stop(10)


@pytest.mark.parametrize("lazy", [False, True])
def test_choices_and_forks_through_the_fleet(lazy, fleet, lazy_fleet, tiny_onnx):
    """n: the prompt read once, its saved state resumed per choice, choice i sampled on seed + i; a fork: the
    session's conversation saved and resumed under the fork's id, each then going on as it would alone."""
    srv = lazy_fleet if lazy else fleet
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 9, "n": 3, "return_token_ids": True})
    assert r.status_code == 200, r.text
    rt = TxlRuntime.load(tiny_onnx)
    for i, choice in enumerate(r.json()["choices"]):
        rt.reset()
        assert choice["index"] == i
        assert choice["token_ids"] == list(rt.generate(PROMPT, params=SamplingParams(max_tokens=6, temperature=1.0,
                                                                                      seed=9 + i)))
    assert r.json()["usage"]["completion_tokens"] == 18 and r.json()["usage"]["prompt_tokens"] == len(PROMPT)
    sid = f"fork-src-{lazy}"
    assert httpx.post(srv.url + "/v1/sessions", json={"id": sid}).status_code == 201
    first = _complete(srv, PROMPT, 4, session_id=sid)
    forked = httpx.post(f"{srv.url}/v1/sessions/{sid}/fork", json={"id": sid + "-f"}, timeout=120)
    assert forked.status_code == 201, forked.text
    assert forked.json()["tokens"] == len(PROMPT) + 4
    mine = _complete(srv, [7, 7, 2], 3, session_id=sid)
    theirs = _complete(srv, "", 3, session_id=sid + "-f")  # the copied next distribution, then its own tokens
    for got, segments in (([first, mine], [(PROMPT, 4), ([7, 7, 2], 3)]), ([first, theirs], [(PROMPT, 4), ([], 3)])):
        want = conversations.greedy_segments(TxlRuntime.load(tiny_onnx), segments)[0]
        for choice, (toks, lps) in zip(got, want, strict=True):
            assert choice["token_ids"] == toks
            np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], [lp[t] for lp, t in zip(lps, toks)],
                                       atol=1e-5)
    for s in (sid, sid + "-f"):
        assert httpx.delete(f"{srv.url}/v1/sessions/{s}").status_code == 200
    # beam search reorders memory rows in place, which the servers do not: refused with the reason
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={"prompt": PROMPT, "num_beams": 2})
    assert r.status_code == 400 and "--triton" in r.json()["error"]["message"]
