"""Beam search over HTTP (`num_beams`, `length_penalty`, `early_stopping`; `n` the best beams returned): the answer is
`TxlRuntime.beam_search`'s on the same prompt and settings, streams running meanwhile get their own tokens, and
what beam search does not take is refused with a 400 that names it."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from txl_deploy.runtimes import SamplingParams
from txl_deploy.serving.http.completion import prompt_decoder

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]


def _beams(srv, **body):
    r = httpx.post(srv.url + "/v1/completions", timeout=120, json={"prompt": PROMPT, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stop_id(reference):
    """A token the best beam of a plain search writes part way: as a stop id, it ends hypotheses early."""
    return reference().beam_search(PROMPT, num_beams=3, max_new_tokens=8)[0].tokens[3]


@pytest.mark.parametrize("settings", [
    dict(num_beams=3, n=2, max_tokens=8),
    dict(num_beams=4, n=3, max_tokens=10, length_penalty=2.0, early_stopping=True, stop=True),
    dict(num_beams=2, max_tokens=6, length_penalty=0.5, early_stopping="never", stop=True),
])
def test_the_http_beams_are_the_runtimes(server, reference, settings):
    stop = [_stop_id(reference)] if settings.pop("stop", False) else []
    body = _beams(server, **settings, **({"stop_token_ids": stop} if stop else {}))
    rt = reference()
    want = rt.beam_search(PROMPT, num_beams=settings["num_beams"], max_new_tokens=settings["max_tokens"],
                          length_penalty=settings.get("length_penalty", 1.0),
                          early_stopping=settings.get("early_stopping", False),
                          num_return_sequences=settings.get("n", 1), stop=stop)
    assert [c["index"] for c in body["choices"]] == list(range(len(want)))
    for choice, beam in zip(body["choices"], want, strict=True):
        assert choice["token_ids"] == beam.tokens
        np.testing.assert_allclose(choice["beam_score"], beam.score, rtol=0, atol=1e-5)
        ended = beam.tokens[-1] in stop
        assert choice["finish_reason"] == ("stop" if ended else "length")
        decoder = prompt_decoder(rt.vocab, PROMPT)  # the text continues the prompt's, as a completion's does
        kept = beam.tokens[:len(beam.tokens) - ended]
        assert choice["text"] == "".join(decoder.feed(t) for t in kept) + decoder.flush()
    if stop:
        assert any(c["finish_reason"] == "stop" for c in body["choices"])
    generated = sum(len(b.tokens) for b in want)
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": generated,
                             "total_tokens": len(PROMPT) + generated}


def test_streams_running_during_a_beam_search_get_their_own_tokens(server, reference):
    params = dict(temperature=1.0, seed=4, max_tokens=30)
    got = {}

    def stream():
        r = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": [7, 8, 9], "return_token_ids": True, **params})
        got["ids"] = r.json()["choices"][0]["token_ids"]

    t = threading.Thread(target=stream)
    t.start()
    beams = [_beams(server, num_beams=4, max_tokens=12, n=1) for _ in range(3)]
    t.join(120)
    assert got["ids"] == list(reference().generate([7, 8, 9], params=SamplingParams(**params)))
    assert beams[0]["choices"] == beams[1]["choices"] == beams[2]["choices"]  # the runtime's memory starts empty


@pytest.mark.parametrize("body, param", [
    ({"num_beams": 3, "temperature": 0.5}, "temperature"),
    ({"num_beams": 3, "stream": True}, "stream"),
    ({"num_beams": 3, "logprobs": 2}, "logprobs"),
    ({"num_beams": 3, "best_of": 3}, "best_of"),
    ({"num_beams": 3, "session_id": "s"}, "session_id"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"early_stopping": True}, "early_stopping"),
    ({"num_beams": 1}, "num_beams"),
    ({"num_beams": 2, "n": 3}, "n"),
    ({"num_beams": 33}, "num_beams"),  # the module's server runs 32 rows
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
])
def test_what_beam_search_does_not_take_gets_a_400(server, body, param):
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].split(".")[0] == param and "\n" not in error["message"], error
