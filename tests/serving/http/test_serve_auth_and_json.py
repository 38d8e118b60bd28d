"""What a client cannot make the server do: read a body before the key is right, block the event loop with a
prompt to tokenize, or send JSON that strict parsers refuse (-Infinity); and a busy session's 409 says when to
retry."""

from __future__ import annotations

import json
import math
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers.engine_gate import EngineGate

from txl_deploy.serving.http.completion import LOGPROB_FLOOR, wire_logprob

PROMPT = "w1 w2 w3 w4"
KEY = "s3cret-key"


def _refuse_constant(name):
    raise ValueError(f"not JSON: {name}")


def _strict(text: str):
    """json.loads as strict parsers read it: NaN, Infinity and -Infinity are errors."""
    return json.loads(text, parse_constant=_refuse_constant)


def _head(path: str, authorization: bytes | None, length: int) -> bytes:
    lines = [b"POST " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1", b"Content-Type: application/octet-stream",
             b"Content-Length: %d" % length]
    if authorization is not None:
        lines.append(b"Authorization: " + authorization)
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _answer(sock, timeout: float) -> tuple[bytes, bytes] | None:
    """The response's head and body, if it began within timeout (None: nothing yet)."""
    sock.settimeout(timeout)
    try:
        reply = sock.recv(65536)
    except TimeoutError:
        return None
    sock.settimeout(10)
    while b"\r\n\r\n" not in reply:
        reply += sock.recv(65536)
    head, _, body = reply.partition(b"\r\n\r\n")
    length = int(next(line.split(b":", 1)[1] for line in head.split(b"\r\n")[1:]
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += sock.recv(65536)
    return head, body


def test_a_wrong_key_is_refused_before_the_body_is_read(make_server):
    srv = make_server(settings={"api_key": KEY})
    size = 1 << 20  # within what a restore may send, so only the key can refuse it
    for authorization in (None, b"Bearer wrong", b"Bearer " + KEY[:-1].encode(), b"Bearer " + KEY.encode() + b"x",
                          b"Basic " + KEY.encode(), b"Bearer \xff\xfe" + KEY.encode()):
        with socket.create_connection((srv.host, srv.port)) as sock:
            sock.sendall(_head("/v1/sessions/s1/restore", authorization, size) + b"\0" * 1000)
            reply = _answer(sock, 10)  # 1,000 of the body's 1 MiB sent: the server answers without the rest
        assert reply is not None, f"no answer without the body for {authorization!r}"
        head, body = reply
        assert head.startswith(b"HTTP/1.1 401"), head
        assert b"www-authenticate: bearer" in head.lower()
        assert json.loads(body)["error"]["code"] == "invalid_api_key"

    # with the right key the server waits for the body, then reads it (not a state: 400)
    with socket.create_connection((srv.host, srv.port)) as sock:
        sock.sendall(_head("/v1/sessions/s1/restore", b"bearer " + KEY.encode(), size) + b"\0" * 1000)
        assert _answer(sock, 0.5) is None
        sock.sendall(b"\0" * (size - 1000))
        reply = _answer(sock, 30)
    assert reply is not None and reply[0].startswith(b"HTTP/1.1 400"), reply
    assert json.loads(reply[1])["error"]["code"] == "invalid_state"


def test_a_busy_session_is_409_with_retry_after(server):
    sid = "busy-retry"
    assert httpx.post(server.url + "/v1/sessions", json={"id": sid}).status_code == 201
    with EngineGate(server.engine) as gate, ThreadPoolExecutor(1) as pool:
        first = pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                            json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "session_id": sid})
        assert gate.held.wait(30)  # the first request is in the engine, its session busy
        for stream in (False, True):
            r = httpx.post(server.url + "/v1/completions", timeout=10,
                           json={"prompt": "w1", "max_tokens": 1, "session_id": sid, "stream": stream})
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
            assert r.headers["retry-after"] == "1"
        gate.open()
        assert first.result().status_code == 200
    assert httpx.delete(f"{server.url}/v1/sessions/{sid}").status_code == 200


def test_prompts_are_tokenized_off_the_event_loop(server):
    vocab = server.engine.vocab
    encode = vocab.encode
    entered, release = threading.Event(), threading.Event()

    def slow_encode(*args, **kwargs):
        entered.set()
        release.wait(60)
        return encode(*args, **kwargs)

    vocab.encode = slow_encode
    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(httpx.post, server.url + "/v1/completions", timeout=60,
                               json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
            assert entered.wait(30)
            # while that prompt is being tokenized, the loop answers others
            assert httpx.get(server.url + "/health", timeout=5).status_code == 200
            r = httpx.post(server.url + "/v1/completions", timeout=5,
                           json={"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            assert not held.done()
            release.set()
            r = held.result()
    finally:
        release.set()
        del vocab.encode
    assert r.status_code == 200 and r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 3,
                                                          "total_tokens": 7}


def test_non_finite_logprobs_are_sent_as_json_strict_parsers_accept(server):
    """A model that rules tokens out (-inf log-probs, as fp16 underflow or masking gives): the top_logprobs list
    them at -9999.0, streamed and not, and the stream's tokens come in the order of the plain response's."""
    engine = server.engine
    run = engine.rows.run
    allowed = 8  # tokens 0..7 keep their log-probs

    def ruling_out(*args, **kwargs):
        out = run(*args, **kwargs)
        if isinstance(out, tuple):  # lazy decoding's (hidden, head): -inf for the shortlist's tokens from 8 and every
            hidden, head = out  # cluster, so the tails computed from the head hold -inf too
            head = np.array(head, copy=True)
            head[..., allowed:] = -np.inf
            return hidden, head
        out = np.array(out, copy=True)
        out[..., allowed:] = -np.inf
        return out

    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 20, "return_token_ids": True}
    engine.rows.run = ruling_out
    try:
        plain = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        streamed = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
    finally:
        engine.rows.run = run
    assert plain.status_code == 200, plain.text
    choice = _strict(plain.text)["choices"][0]
    assert all(t < allowed for t in choice["token_ids"])
    assert all(LOGPROB_FLOOR < lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    for top in choice["logprobs"]["top_logprobs"]:
        assert len(top) == 20
        assert sorted(top.values())[:20 - allowed] == [LOGPROB_FLOOR] * (20 - allowed)

    assert streamed.status_code == 200
    data = [line.removeprefix("data: ") for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [_strict(d) for d in data[:-1]]
    ids, token_logprobs, tops = [], [], []
    for event in events:
        for c in event["choices"]:
            ids += c.get("token_ids") or []
            if c["logprobs"] is not None:
                token_logprobs += c["logprobs"]["token_logprobs"]
                tops += c["logprobs"]["top_logprobs"]
    assert ids == choice["token_ids"]
    assert token_logprobs == choice["logprobs"]["token_logprobs"]
    assert tops == choice["logprobs"]["top_logprobs"]


@pytest.mark.parametrize("value, sent", [(-math.inf, LOGPROB_FLOOR), (math.nan, LOGPROB_FLOOR),
                                         (math.inf, LOGPROB_FLOOR), (-1e30, LOGPROB_FLOOR),
                                         (np.float32(-2.5), -2.5), (-9998.5, -9998.5), (0.0, 0.0)])
def test_the_logprob_rule(value, sent):
    assert wire_logprob(value) == sent and isinstance(wire_logprob(value), float)
