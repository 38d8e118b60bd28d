"""Conversations that fork: `POST /v1/sessions/ID/fork` makes a session holding a copy of the memory and the next
distribution; each fork then continues as the conversation would have alone, and writing one never changes the
other. A parked state forks by being restored under several ids. Forks count against --max-sessions as new sessions
do, and a busy session is not forked (409)."""

from __future__ import annotations

import threading

import httpx
import numpy as np
from helpers import conversations

from txl_deploy.runtimes import TxlRuntime

A = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # two prefill chunks (max_segment 16)
X, Y = [7, 7, 2], [11, 30, 4, 4, 9]


def _complete(c, sid, prompt, n):
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1,
                                         "return_token_ids": True, "session_id": sid})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _assert_turns(choices, tiny_onnx, segments):
    """The session's answers equal one TxlRuntime stream fed the same turns (greedy, log-probs to 1e-5)."""
    want, _ = conversations.greedy_segments(TxlRuntime.load(tiny_onnx), segments)
    for choice, (toks, lps) in zip(choices, want, strict=True):
        assert choice["token_ids"] == toks
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], [lp[t] for lp, t in zip(lps, toks)],
                                   rtol=0, atol=1e-5)


def test_a_fork_continues_as_its_source_would_and_they_stay_independent(make_server, tiny_onnx):
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        assert c.post("/v1/sessions", json={"id": "src"}).status_code == 201
        first = _complete(c, "src", A, 4)
        r = c.post("/v1/sessions/src/fork", json={"id": "left"})
        assert r.status_code == 201, r.text
        info = r.json()
        assert info["id"] == "left" and info["state"] == "idle" and info["tokens"] == len(A) + 4
        named = c.post("/v1/sessions/src/fork")  # no id: the server names it, as it names a new session
        assert named.status_code == 201 and named.json()["id"].startswith("sess-")
        right = named.json()["id"]
        # the source goes on first, then the forks: what it wrote is in none of them
        src = [_complete(c, "src", X, 3), _complete(c, "src", Y, 2)]
        left = [_complete(c, "left", Y, 5)]
        right_turns = [_complete(c, right, [], 3), _complete(c, right, X, 2)]  # no prompt: the copied distribution
        assert c.get("/v1/sessions/src").json()["tokens"] == len(A) + 4 + len(X) + 3 + len(Y) + 2
        assert c.get("/v1/sessions/left").json()["tokens"] == len(A) + 4 + len(Y) + 5
    base = [(A, 4)]
    _assert_turns([first] + src, tiny_onnx, base + [(X, 3), (Y, 2)])
    _assert_turns([first] + left, tiny_onnx, base + [(Y, 5)])
    _assert_turns([first] + right_turns, tiny_onnx, base + [([], 3), (X, 2)])


def test_a_parked_state_forks_by_being_restored_under_several_ids(make_server, tiny_onnx):
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        assert c.post("/v1/sessions", json={"id": "p"}).status_code == 201
        first = _complete(c, "p", A, 4)
        blob = c.post("/v1/sessions/p/park").content
        for sid in ("p1", "p2"):
            assert c.post(f"/v1/sessions/{sid}/restore", content=blob).status_code == 201
        one = _complete(c, "p1", X, 3)
        # a restored session forks like any other
        assert c.post("/v1/sessions/p2/fork", json={"id": "p3"}).status_code == 201
        two, three = _complete(c, "p2", Y, 2), _complete(c, "p3", [], 4)
    _assert_turns([first, one], tiny_onnx, [(A, 4), (X, 3)])
    _assert_turns([first, two], tiny_onnx, [(A, 4), (Y, 2)])
    _assert_turns([first, three], tiny_onnx, [(A, 4), ([], 4)])


def _wait_running(c, sid):
    for _ in range(500):
        if c.get(f"/v1/sessions/{sid}").json()["state"] == "running":
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"{sid} never ran")


def test_forks_are_bounded_as_new_sessions_and_busy_sessions_are_not_forked(make_server):
    srv = make_server(max_sessions=2)
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        for sid in ("a", "b"):
            assert c.post("/v1/sessions", json={"id": sid}).status_code == 201
            _complete(c, sid, A, 2)
        # over --max-sessions: the least recently used idle session is evicted for the fork, as for a new session
        assert c.post("/v1/sessions/b/fork", json={"id": "c"}).status_code == 201
        assert "evicted" in c.get("/v1/sessions/a").json()["error"]["message"]
        assert c.post("/v1/sessions/c/fork", json={"id": "b"}).json()["error"]["code"] == "session_exists"
        assert c.post("/v1/sessions/nobody/fork").status_code == 404
        # every session busy: the fork gets the 429 a new session gets
        hold = threading.Event()
        run = srv.engine.rows.run

        def slow(*args, **kwargs):
            hold.wait(30)
            return run(*args, **kwargs)

        srv.engine.rows.run = slow
        busy = [threading.Thread(target=lambda sid=sid: _complete(c, sid, X, 1)) for sid in ("b", "c")]
        try:
            busy[0].start()
            _wait_running(c, "b")
            forked = c.post("/v1/sessions/c/fork", json={"id": "d"})  # c forking, b running: none to evict
            refused = c.post("/v1/sessions/b/fork", json={"id": "e"})  # a running session is not forked
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "session_busy"
            busy[1].start()
            _wait_running(c, "c")
            created = c.post("/v1/sessions", json={"id": "d"})  # b and c running
            assert forked.status_code == created.status_code == 429, (forked.text, created.text)
            assert forked.json()["error"]["code"] == created.json()["error"]["code"] == "sessions_full"
        finally:
            hold.set()
            srv.engine.rows.run = run
            for t in busy:
                t.join(60)
        # an empty session forks into an empty one
        c.delete("/v1/sessions/c")
        assert c.post("/v1/sessions", json={"id": "empty"}).status_code == 201
        assert c.post("/v1/sessions/empty/fork", json={"id": "empty2"}).json()["tokens"] == 0
        assert c.get("/v1/sessions/b").status_code == 404
    free, used = srv.engine.call(lambda: (len(srv.engine.rows.free), len(srv.engine.rows.used))).result(10)
    assert used == 0 and free == srv.engine.rows.size  # b was evicted for the fork; empty sessions hold no row
