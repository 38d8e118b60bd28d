"""Sessions: continuing one gives exactly the log-probs of one long TxlRuntime stream; park returns the memory and
restore brings it back (also under another id), refusing anything that is not this model's state; LRU eviction and
the idle TTL end sessions, and a request for a session that is gone is a 404 that says why, never a fresh memory."""

from __future__ import annotations

import io
import json
import threading
import time

import httpx
import numpy as np
import pytest
from helpers import conversations, streams
from helpers.tiny import TINY_VOCAB, make_tiny_model

from txl_deploy.runtimes import SamplingParams, TxlRuntime

A = [int(t) for t in np.random.default_rng(7).integers(0, 58, size=20)]  # longer than mem_len 12 and max_segment 16
B = [5, 9, 13, 2]


def _complete(srv, session, prompt, n, **extra):
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 20, "return_token_ids": True,
        "session_id": session, **extra})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _top20(choice, vocab):
    """Per generated token: the top-20 (token id, log-prob) the server reported."""
    index = {vocab.piece(i): i for i in range(len(vocab))}
    return [[(index[k], v) for k, v in top.items()] for top in choice["logprobs"]["top_logprobs"]]


def _reference_stream(tiny_onnx, segments):
    """One TxlRuntime stream: each (prompt, n) feeds the prompt (in max_segment pieces, as prefill does), then n
    greedy tokens, each fed too. Returns per request the tokens and their full log-prob rows, and the runtime."""
    rt = TxlRuntime.load(tiny_onnx)
    out, lp = conversations.greedy_segments(rt, segments)
    return out, rt, lp


def _assert_same(choice, toks, lps, vocab):
    assert choice["token_ids"] == toks
    for got, lp in zip(_top20(choice, vocab), lps):
        ids = [i for i, _ in got]
        want = np.argsort(-lp, kind="stable")[:20]
        assert ids == want.tolist()
        # exactly: the session's row is computed as the lone stream is (float32 values, sent as JSON numbers)
        assert [v for _, v in got] == [float(lp[i]) for i in ids]


def test_continuing_a_session_is_one_long_stream(make_server, tiny_onnx):
    srv = make_server()
    vocab = srv.engine.vocab
    r = httpx.post(srv.url + "/v1/sessions", json={"id": "chat-1"})
    assert r.status_code == 201 and r.json()["tokens"] == 0
    assert r.json()["memory_bytes"] == srv.engine.bytes_per_session
    got = [_complete(srv, "chat-1", A, 6), _complete(srv, "chat-1", B, 4), _complete(srv, "chat-1", "", 5)]
    want, _, last = _reference_stream(tiny_onnx, [(A, 6), (B, 4), ([], 5)])
    for choice, (toks, lps) in zip(got, want):
        _assert_same(choice, toks, lps, vocab)
    info = httpx.get(srv.url + "/v1/sessions/chat-1").json()
    assert info["tokens"] == len(A) + 6 + len(B) + 4 + 5 and not info["busy"]
    # the memory holds every generated token: its next-token log-probs are the long stream's, bit for bit
    session = srv.engine.sessions.get("chat-1")
    np.testing.assert_array_equal(session.last_log_probs, last)


def test_park_and_restore_continue_exactly(make_server, tiny_onnx):
    srv = make_server()
    vocab = srv.engine.vocab
    httpx.post(srv.url + "/v1/sessions", json={"id": "p"})
    first = _complete(srv, "p", A, 3)
    parked = httpx.post(srv.url + "/v1/sessions/p/park")
    assert parked.status_code == 200 and parked.headers["content-type"] == "application/octet-stream"
    gone = httpx.post(srv.url + "/v1/completions", json={"prompt": B, "session_id": "p"})
    assert gone.status_code == 404 and "was parked" in gone.json()["error"]["message"]
    # the bytes are TxlRuntime.save_state's .npz: they load in-process too
    rt = TxlRuntime.load(tiny_onnx)
    with np.load(io.BytesIO(parked.content), allow_pickle=False) as z:
        state = {k: z[k] for k in z.files}
    rt.load_state(state)
    assert rt.batch_size == 1
    # restored under another id, the conversation goes on as if never parked
    r = httpx.post(srv.url + "/v1/sessions/q/restore", content=parked.content)
    assert r.status_code == 201 and r.json()["tokens"] == len(A) + 3
    second = _complete(srv, "q", B, 4)
    third = _complete(srv, "q", "", 2)
    want, _, _ = _reference_stream(tiny_onnx, [(A, 3), (B, 4), ([], 2)])
    for choice, (toks, lps) in zip([first, second, third], want):
        _assert_same(choice, toks, lps, vocab)
    again = httpx.post(srv.url + "/v1/sessions/q/restore", content=parked.content)
    assert again.status_code == 409 and again.json()["error"]["code"] == "session_exists"


def _npz(arrays) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_restore_refuses_other_models_states_and_garbage(make_server):
    srv = make_server()
    httpx.post(srv.url + "/v1/sessions", json={"id": "mine"})
    _complete(srv, "mine", A, 2)
    with np.load(io.BytesIO(httpx.post(srv.url + "/v1/sessions/mine/park").content), allow_pickle=False) as z:
        state = {k: z[k] for k in z.files}
    other_model = dict(state, __fingerprint__=np.array("a model with other weights"))
    other_shape = dict(state)
    name = next(k for k in state if k.startswith("mem_k"))
    other_shape[name] = state[name][..., :5]  # a shorter memory: another model's layout
    two_rows = {k: (np.concatenate([v, v]) if not k.startswith("__") else v) for k, v in state.items()}
    for body, what in ((_npz(other_model), "another model"), (_npz(other_shape), "another memory length"),
                       (_npz(two_rows), "two rows"), (b"not a state at all", "garbage"),
                       (b"PK\x03\x04" + b"\0" * 100, "a broken zip")):
        r = httpx.post(srv.url + "/v1/sessions/x/restore", content=body)
        assert r.status_code == 400, what
        assert r.json()["error"]["code"] == "invalid_state", what
    assert httpx.get(srv.url + "/v1/sessions/x").status_code == 404  # nothing was made
    assert httpx.post(srv.url + "/v1/sessions/x/restore", content=b"").status_code == 400
    big = b"\0" * (srv.engine.bytes_per_session + (2 << 20))
    assert httpx.post(srv.url + "/v1/sessions/x/restore", content=big).status_code == 413


def test_least_recently_used_session_is_evicted_and_says_so(make_server):
    srv = make_server(max_sessions=2)
    for sid in ("a", "b"):
        assert httpx.post(srv.url + "/v1/sessions", json={"id": sid}).status_code == 201
    _complete(srv, "b", A, 1)
    _complete(srv, "a", A, 1)  # a is now the most recently used
    assert httpx.post(srv.url + "/v1/sessions", json={"id": "c"}).status_code == 201
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": B, "session_id": "b"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_gone"
    assert "was evicted" in r.json()["error"]["message"] and "least recently used" in r.json()["error"]["message"]
    assert len(_complete(srv, "a", B, 2)["token_ids"]) == 2
    assert sorted(s["id"] for s in httpx.get(srv.url + "/v1/sessions").json()["data"]) == ["a", "c"]
    # the evicted session's row went back to the pool: 2 sessions' rows + 8 request rows, one session row unused
    assert len(srv.engine.rows.free) == 10 - 1


def test_idle_sessions_expire(make_server):
    srv = make_server(session_ttl=0.5)
    httpx.post(srv.url + "/v1/sessions", json={"id": "t"})
    _complete(srv, "t", A, 1)
    time.sleep(1.5)
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": B, "session_id": "t"})
    assert r.status_code == 404 and "expired" in r.json()["error"]["message"]
    assert httpx.get(srv.url + "/v1/sessions/t").status_code == 404
    assert len(srv.engine.rows.free) == 8 + 8  # its row is free again (8 request rows, 8 session rows)


def test_unknown_busy_deleted_and_empty_sessions(make_server):
    srv = make_server()
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": B, "session_id": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert "does not exist" in r.json()["error"]["message"]
    made = httpx.post(srv.url + "/v1/sessions").json()
    sid = made["id"]
    assert sid.startswith("sess-")
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "", "session_id": sid})
    assert r.status_code == 400 and "has no text yet" in r.json()["error"]["message"]
    assert httpx.post(srv.url + "/v1/sessions", json={"id": sid}).status_code == 409
    # one request at a time per session
    started, leave = threading.Event(), threading.Event()

    def long_request():  # streams until told to go away (the client disconnects: the request ends)
        with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
                "prompt": A, "max_tokens": 4000, "temperature": 0, "stream": True, "session_id": sid}) as r:
            for _ in r.iter_lines():
                started.set()
                if leave.is_set():
                    break

    t = threading.Thread(target=long_request)
    t.start()
    try:
        assert started.wait(30)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": B, "session_id": sid})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
        assert httpx.delete(srv.url + f"/v1/sessions/{sid}").status_code == 409  # not while it runs
    finally:
        leave.set()
        t.join(60)
    end = time.monotonic() + 30
    while httpx.get(srv.url + f"/v1/sessions/{sid}").json()["busy"]:  # the disconnect ends the request
        assert time.monotonic() < end
        time.sleep(0.02)
    assert httpx.delete(srv.url + f"/v1/sessions/{sid}").json() == {"id": sid, "object": "session", "deleted": True}
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": B, "session_id": sid})
    assert r.status_code == 404 and "was deleted" in r.json()["error"]["message"]
    assert httpx.post(srv.url + "/v1/sessions", json={"id": "bad id!"}).status_code == 400


def _streamed(r) -> tuple[str, list[int], str]:
    """A streamed completion's text, token ids and finish reason, read from its server-sent events."""
    text, ids, reasons = "", [], []
    for line in r.iter_lines():
        if line.startswith("data: {"):
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["text"]
            ids += choice.get("token_ids") or []
            reasons.append(choice["finish_reason"])
    return text, ids, reasons[-1]


@pytest.mark.parametrize("stream", [False, True])
def test_a_session_takes_its_stop_string_tokens_into_memory(make_server, tiny_onnx, stream):
    """The text returned leaves a stop string out; the memory holds every token generated (documented)."""
    srv = make_server()
    # sampled, not greedy: the tiny model's greedy continuation repeats one word, so a stop string would match at
    # once and leave no text to check
    sampling = dict(temperature=1.0, seed=0)
    toks = list(TxlRuntime.load(tiny_onnx).generate(A, params=SamplingParams(max_tokens=8, **sampling)))
    vocab = srv.engine.vocab
    pieces = [vocab.piece(t) for t in toks]
    stop = pieces[3] + pieces[4]  # across a token boundary
    # the request ends at the token that completes the stop string's first match in the text
    ends = next(k for k in range(1, len(toks) + 1) if stop in "".join(pieces[:k]))
    text = "".join(pieces)
    want_text = text[:text.index(stop)]
    assert want_text and ends < len(toks)  # text to return, and tokens the stop string cut off
    httpx.post(srv.url + "/v1/sessions", json={"id": "s"})
    body = {"prompt": A, "max_tokens": len(toks), **sampling, "stop": [stop], "session_id": "s", "stream": stream,
            "return_token_ids": True}
    with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        if stream:
            got_text, got_ids, reason = _streamed(r)
        else:
            r.read()
            choice = r.json()["choices"][0]
            got_text, got_ids, reason = choice["text"], choice["token_ids"], choice["finish_reason"]
    assert (got_text, got_ids, reason) == (want_text, toks[:ends], "stop")
    info = httpx.get(srv.url + "/v1/sessions/s").json()
    assert info["tokens"] == len(A) + ends
    # the memory is that of one stream fed the prompt and every token generated, the one that ended it too. The
    # server computes each step's full distribution (without --lazy), so the stream is generate's on that path: its
    # lazy path composes the last distribution from the softmax's parts, whose numbers may differ in the last bit
    rt = TxlRuntime.load(tiny_onnx, lazy=False)
    assert list(rt.generate(A, params=SamplingParams(max_tokens=ends, **sampling))) == toks[:ends]
    want = rt.save_state()
    np.testing.assert_array_equal(srv.engine.sessions.get("s").last_log_probs, want["__last_log_probs__"][0])
    parked = httpx.post(srv.url + "/v1/sessions/s/park")
    assert parked.status_code == 200
    with np.load(io.BytesIO(parked.content), allow_pickle=False) as z:
        streams.assert_state_equal({k: z[k] for k in z.files}, want)



@pytest.fixture(scope="module")
def full_context_ckpt(tmp_path_factory):
    """The tiny model without same_length: a position sees its memory and every earlier position of its segment,
    as the demo model and the paper's models do. Served through PyTorch (no export needed)."""
    from txl_deploy.checkpoints import save_checkpoint
    from txl_deploy.vocab import Vocab

    path = tmp_path_factory.mktemp("ckpt") / "full-context"
    save_checkpoint(path, make_tiny_model(same_length=False), Vocab(TINY_VOCAB))
    return path


@pytest.mark.parametrize("same_length", [False, True], ids=["full-context", "same-length"])
def test_a_session_equals_its_turns_not_the_conversation_resent_whole(make_server, full_context_ckpt, same_length):
    """What docs/serving.md promises, and what it does not: a session is its turns fed in their pieces. The same
    tokens re-sent as one prompt are cut into other segments: equal up to rounding while they fit the memory
    (mem_len 12); once they outgrow it, each position's context depends on where its segment starts, so the
    numbers differ beyond rounding, except for a same_length model (every position sees mem_len tokens back)."""
    srv = make_server() if same_length else make_server(model=full_context_ckpt)

    def next_log_probs(session, turns):
        httpx.post(srv.url + "/v1/sessions", json={"id": session})
        for turn in turns:
            _complete(srv, session, turn, 0)  # max_tokens 0: the prompt is fed, nothing generated
        return srv.engine.sessions.get(session).last_log_probs

    short = [5, 9, 13, 2, 7], [11, 3, 8, 1]
    turns, whole = next_log_probs("short-turns", short), next_log_probs("short-whole", [short[0] + short[1]])
    np.testing.assert_allclose(turns, whole, rtol=0, atol=1e-5)
    turns, whole = next_log_probs("long-turns", [A, B]), next_log_probs("long-whole", [A + B])
    if same_length:
        np.testing.assert_allclose(turns, whole, rtol=0, atol=1e-5)
    else:
        assert np.abs(turns - whole).max() > 1e-3
