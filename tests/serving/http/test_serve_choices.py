"""`n` and `best_of`: the prompt is read once and copied into a row per choice; choice i samples on seed + i, so it
is what a lone request with that seed gives; best_of returns the n whose log-probs sum highest; usage counts the
prompt once; more rows than --max-batch, a session, or best_of above n streamed get a 400."""

from __future__ import annotations

import json
import threading

import httpx
import numpy as np
import pytest

from txl_deploy.runtimes import SamplingParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]  # two prefill chunks (max_segment 16)
SAMPLED = {"temperature": 1.0, "top_k": 20, "seed": 7, "max_tokens": 10, "logprobs": 1, "return_token_ids": True}


def _post(srv, **body):
    return httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPT, **SAMPLED, **body}, timeout=120)


def _lone(srv, seed):
    r = _post(srv, seed=seed)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_choice_i_is_the_lone_request_with_seed_plus_i(server, reference):
    r = _post(server, n=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for i, choice in enumerate(body["choices"]):
        lone = _lone(server, SAMPLED["seed"] + i)
        assert choice["token_ids"] == lone["token_ids"] and choice["text"] == lone["text"]
        # equal to float rounding: a batch of several rows is summed in another order than one row
        np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], lone["logprobs"]["token_logprobs"],
                                   rtol=0, atol=1e-5)
        # and what TxlRuntime.generate samples with that seed
        rt = reference()
        want = list(rt.generate(PROMPT, params=SamplingParams(temperature=1.0, top_k=20, seed=7 + i, max_tokens=10)))
        assert choice["token_ids"] == want
    assert len({tuple(c["token_ids"]) for c in body["choices"]}) > 1  # the seeds did make different choices
    generated = sum(len(c["token_ids"]) for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": generated,
                             "total_tokens": len(PROMPT) + generated}


def test_the_prompt_is_read_once_and_copied_into_the_choices_rows(make_server):
    srv = make_server(max_batch=4)
    engine = srv.engine
    run, copy, calls, copies = engine.rows.run, engine.rows.copy, [], []
    engine.rows.run = lambda rows, tokens, *a, **k: (calls.append((list(rows), tokens.shape)), run(rows, tokens, *a,
                                                                                                     **k))[1]
    engine.rows.copy = lambda row, rows: (copies.append((row, list(rows))), copy(row, rows))[1]
    r = _post(srv, n=4, max_tokens=3)
    assert r.status_code == 200, r.text
    prefill = [c for c in calls if c[1][1] > 1]
    assert [shape for _, shape in prefill] == [(1, 16), (1, 4)]  # one row reads the prompt, in its two chunks
    (source, rows), = copies
    assert source not in rows and len(set(rows)) == 3
    assert all(len(rows) <= 4 for rows, _ in calls)
    engine.rows.run, engine.rows.copy = run, copy
    assert srv.engine.call(lambda: (len(engine.rows.used), engine.running)).result(10) == (0, 0)


def test_best_of_returns_the_n_with_the_highest_summed_log_probs(server):
    r = _post(server, n=2, best_of=4)
    assert r.status_code == 200, r.text
    body = r.json()
    lone = [_lone(server, SAMPLED["seed"] + i) for i in range(4)]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in lone]
    best = sorted(range(4), key=lambda i: -sums[i])[:2]
    assert [c["token_ids"] for c in body["choices"]] == [lone[i]["token_ids"] for i in best]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # usage counts every completion generated, the two left out too
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in lone)
    assert body["usage"]["prompt_tokens"] == len(PROMPT)


def test_n_streamed_carries_each_choice_by_index(server):
    whole = _post(server, n=2).json()
    texts, ids, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, json={
            "prompt": PROMPT, **SAMPLED, "n": 2, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held in a name: the stream is read to its end
        events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    for event in events[:-2]:
        (choice,) = json.loads(event)["choices"]
        texts[choice["index"]] += choice["text"]
        ids[choice["index"]] += choice.get("token_ids") or []
        if choice["finish_reason"] is not None:
            finish[choice["index"]] = choice["finish_reason"]
    for c in whole["choices"]:
        assert (texts[c["index"]], ids[c["index"]], finish[c["index"]]) == (c["text"], c["token_ids"],
                                                                            c["finish_reason"])
    assert usage["usage"] == whole["usage"]


def test_the_openai_client_reads_n_choices(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=2, best_of=3, temperature=1.0,
                                  seed=3)
    assert [c.index for c in r.choices] == [0, 1] and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 15


@pytest.mark.parametrize("body, param, words", [
    ({"n": 33}, "n", "--max-batch"),  # the module's server runs 32 rows
    ({"n": 2, "best_of": 40}, "best_of", "--max-batch"),
    ({"n": 0}, "n", "at least 1"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of at least n"),
    ({"n": 2, "session_id": "s"}, "session_id", "fork"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of", "cannot be streamed"),
])
def test_choices_beyond_what_the_server_allows_get_a_400(server, body, param, words):
    r = _post(server, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"] and "\n" not in error["message"]
    assert httpx.get(server.url + "/health").status_code == 200
    assert np.all(server.engine.call(lambda: server.engine.running == 0).result(10))


def test_choices_decoded_lazily_are_generates(make_server, reference):
    """`serve --lazy`: the choices' rows take copies of the prompt's hidden vector and head, and each decides its
    tokens from them as generate does with its seed."""
    srv = make_server(max_batch=4, lazy=True)
    assert srv.engine.lazy
    r = _post(srv, n=3, best_of=3)
    assert r.status_code == 200, r.text
    for i, choice in enumerate(r.json()["choices"]):
        rt = reference()
        want = list(rt.generate(PROMPT, params=SamplingParams(temperature=1.0, top_k=20, seed=7 + i, max_tokens=10)))
        assert choice["token_ids"] == want


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_frees_every_choices_row(make_server, stream):
    srv = make_server(max_batch=4)
    engine = srv.engine
    body = {"prompt": PROMPT, "max_tokens": 4000, "temperature": 1.0, "n": 4, "stream": stream}
    if stream:
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()  # held in a name: leaving the block, not the loop, closes the connection
            next(line for line in lines if line.startswith("data: {"))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)  # 4 x 4000 tokens take longer
    for _ in range(500):
        if engine.call(lambda: (engine.running, len(engine.rows.used))).result(10) == (0, 0):
            break
        threading.Event().wait(0.01)
    assert engine.call(lambda: (engine.running, len(engine.rows.used))).result(10) == (0, 0)
    assert _post(srv, n=4, max_tokens=2).status_code == 200  # and all four rows are there again
