"""`echo` on /v1/completions, as OpenAI's completions API gives it: the prompt's text before the completion, and
with `logprobs` each prompt token's log-prob and alternatives (the first one null, unless a session's memory precedes
it), `text_offset` running on through the completion; the numbers are TxlRuntime.score's on the same ids.
`max_tokens: 0` scores without generating; a session's prompt is scored in its context and then held; streamed, the
prompt is the first chunk. The local engine, lazy or not (the Triton fleet's are in test_serve_triton_fleet.py)."""

from __future__ import annotations

import itertools
import json

import httpx
import numpy as np
import pytest

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5, 0]  # > 2 segs
TOL = dict(rtol=1e-5, atol=1e-5)  # float32 rounding: the server's chunks are not score()'s


def _post(srv, **body):
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _scored(make_rt, context, prompt, k):
    """What the prompt's tokens are given `context` before them (fed first, as a session holds it): their
    log-probs (score's) and the k most likely tokens at each prompt position after the first (step's)."""
    rt = make_rt()
    try:
        ids = np.asarray(list(context) + list(prompt), dtype=np.int64)[None]
        logprobs = -rt.score(ids)[0][len(context) - 1 if context else 0:]
        rt.reset()
        dists = rt.step(ids)[0][len(context) - 1 if context else 0:-1]
        tops = [np.argsort(-d, kind="stable")[:k].tolist() for d in dists]
        return logprobs, tops, rt.vocab
    finally:
        rt.close()


def _check_prompt_part(choice, make_rt, prompt, k, context=()):
    n = len(prompt)
    lp = choice["logprobs"]
    logprobs, tops, vocab = _scored(make_rt, context, prompt, k)
    first = 0 if context else 1  # with no context the first token has nothing to be scored on
    if not context:
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    np.testing.assert_allclose(lp["token_logprobs"][first:n], logprobs, **TOL)
    for top, want in zip(lp["top_logprobs"][first:n], tops):
        assert list(top) == [vocab.piece(t) for t in want]
    assert lp["tokens"][:n] == [vocab.piece(t) for t in prompt]


def test_echo_returns_the_prompt_scored_as_score_then_the_same_completion(server, reference):
    plain = _post(server, prompt=PROMPT, max_tokens=5, logprobs=3)["choices"][0]
    out = _post(server, prompt=PROMPT, max_tokens=5, logprobs=3, echo=True)
    choice = out["choices"][0]
    _check_prompt_part(choice, reference, PROMPT, 3)
    lp, n = choice["logprobs"], len(PROMPT)
    prompt_text = choice["text"][:len(choice["text"]) - len(plain["text"])]
    assert choice["text"] == prompt_text + plain["text"] and prompt_text.strip()
    # the completion is the one without echo; its offsets run on after the prompt's text
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"][n:] == [len(prompt_text) + o for o in plain["logprobs"]["text_offset"]]
    offsets = lp["text_offset"][:n + 1]
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[n] == len(prompt_text)
    assert out["usage"] == {"prompt_tokens": n, "completion_tokens": 5, "total_tokens": n + 5}


def test_max_tokens_zero_scores_without_generating(server, reference):
    out = _post(server, prompt="w1 w7 w3 w9 w2", max_tokens=0, logprobs=2, echo=True)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    ids = reference().encode("w1 w7 w3 w9 w2").tolist()
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    _check_prompt_part(choice, reference, ids, 2)
    assert choice["text"].split() == "w1 w7 w3 w9 w2".split()


def test_echo_without_logprobs_returns_the_text_only(server):
    plain = _post(server, prompt="w4 w8 w15", max_tokens=4)["choices"][0]
    choice = _post(server, prompt="w4 w8 w15", max_tokens=4, echo=True)["choices"][0]
    assert choice["logprobs"] is None
    assert choice["text"].endswith(plain["text"]) and choice["text"][:-len(plain["text"])].split() == \
        ["w4", "w8", "w15"]


def test_a_sessions_prompt_is_scored_in_its_context_and_then_held(server, reference):
    sid = "echo-chat"
    assert httpx.post(server.url + "/v1/sessions", json={"id": sid}).status_code == 201
    try:
        first = _post(server, prompt=PROMPT[:20], max_tokens=3, session_id=sid, return_token_ids=True)
        context = PROMPT[:20] + first["choices"][0]["token_ids"]
        second = [7, 2, 9, 9, 1, 4]
        choice = _post(server, prompt=second, max_tokens=0, logprobs=4, echo=True, session_id=sid)["choices"][0]
        assert choice["logprobs"]["token_logprobs"][0] is not None  # the session's memory precedes it
        _check_prompt_part(choice, reference, second, 4, context=context)
        held = httpx.get(f"{server.url}/v1/sessions/{sid}").json()
        assert held["tokens"] == len(context) + len(second)
        # the session goes on from the scored prompt: what a runtime fed the same ids continues with
        after = _post(server, prompt="", max_tokens=4, session_id=sid, return_token_ids=True)
        rt = reference()
        want = list(rt.generate(context + second, max_new_tokens=4, temperature=0.0))
        rt.close()
        assert after["choices"][0]["token_ids"] == want
    finally:
        httpx.delete(f"{server.url}/v1/sessions/{sid}")


def _streamed(srv, **body):
    chunks = []
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=120,
                      json={"temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"])
    return [c[0] for c in chunks if c]


def test_streaming_sends_the_echoed_prompt_first_with_its_logprobs(server):
    whole = _post(server, prompt=PROMPT, max_tokens=6, logprobs=2, echo=True)["choices"][0]
    chunks = _streamed(server, prompt=PROMPT, max_tokens=6, logprobs=2, echo=True)
    head = chunks[0]
    assert head["logprobs"]["tokens"] == whole["logprobs"]["tokens"][:len(PROMPT)]
    assert head["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    got = {k: list(itertools.chain.from_iterable(c["logprobs"][k] for c in chunks if c["logprobs"]))
           for k in whole["logprobs"]}
    assert got == whole["logprobs"] and chunks[-1]["finish_reason"] == "length"


def test_the_openai_client_reads_the_echoed_prompt(client):
    c = client.completions.create(model="tiny", prompt="w1 w2 w3", max_tokens=0, echo=True, logprobs=1)
    assert c.choices[0].text.split() == ["w1", "w2", "w3"] and c.choices[0].finish_reason == "length"
    assert c.choices[0].logprobs.token_logprobs[0] is None and len(c.choices[0].logprobs.tokens) == 3


@pytest.mark.parametrize("k", [0, 5])
def test_the_lazy_engine_scores_the_prompt_on_full_distributions(make_server, reference, k):
    srv = make_server(lazy=True)
    assert srv.engine.lazy
    plain = _post(srv, prompt=PROMPT, max_tokens=5, logprobs=k)["choices"][0]
    choice = _post(srv, prompt=PROMPT, max_tokens=5, logprobs=k, echo=True)["choices"][0]
    _check_prompt_part(choice, reference, PROMPT, k)
    assert choice["logprobs"]["tokens"][len(PROMPT):] == plain["logprobs"]["tokens"]


def test_a_word_models_echoed_prompt_is_its_detokenized_text(make_server, wikitext_onnx):
    """A WikiText-103-style prompt comes back as the detokenized text of its tokens ("1,000", not "1 @,@ 000"),
    the offsets cut it into each token's text, and the completion follows it as it would without echo."""
    pytest.importorskip("torch")
    from helpers.word_models import NATURAL_LINE

    srv = make_server(model=wikitext_onnx)
    body = {"prompt": NATURAL_LINE, "max_tokens": 8, "temperature": 1.5, "seed": 4, "logprobs": 1}
    plain = _post(srv, **body)["choices"][0]
    choice = _post(srv, **body, echo=True)["choices"][0]
    assert choice["text"] == NATURAL_LINE + plain["text"]
    lp, n = choice["logprobs"], len(choice["logprobs"]["tokens"]) - 8
    assert "@,@" in [t.strip() for t in lp["tokens"][:n]] and lp["text_offset"][n] == len(NATURAL_LINE)
    cuts = lp["text_offset"][:n] + [len(NATURAL_LINE)]
    assert "".join(NATURAL_LINE[a:b] for a, b in itertools.pairwise(cuts)) == NATURAL_LINE
    assert all(a <= b for a, b in itertools.pairwise(cuts))
