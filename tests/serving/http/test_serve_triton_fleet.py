"""`txl-deploy serve --triton`: the same API, served through Triton servers (the bundled tritonserver on loopback,
two of them): completions equal the local server's and TxlRuntime's, sessions stay on one server and continue
exactly, park and restore go through the Triton model's parked states; a restore raced by a delete or a request
leaves no conversation open for a session that is gone, and a fleet whose own bookkeeping fails stops and says so."""

from __future__ import annotations

import functools
import json
import threading
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
from txl_deploy.serving.triton.client import rendezvous_order  # noqa: E402
from txl_deploy.serving.triton.repository import write_repository  # noqa: E402

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # longer than one request (16 tokens)


@pytest.fixture(scope="module")
def tritons(tritonserver, tiny_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer

    repo = write_repository(tiny_onnx, tmp_path_factory.mktemp("fleet") / "repo", backend="python", max_batch=4,
                            max_sequences=16, idle_timeout=120, threads=1)
    started = [TritonServer(repo) for _ in range(2)]
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
