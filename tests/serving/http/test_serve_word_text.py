"""A WikiText-103-style word model over HTTP: a natural-text prompt is tokenized as WikiText-103 was (Moses), the
completion's text is the detokenized text of the tokens it sampled, streamed chunks join to exactly that text, the
log-prob text offsets run through it, and `ban_unk` keeps `<unk>` out of it as `TxlRuntime.generate(ban_unk=True)`
does, where the model would write it.

The model is `helpers.word_models`' tiny random one: seeded sampling at a high temperature writes numbers, dashes,
quotes and brackets next to each other, which is what the detokenizer has to join."""

from __future__ import annotations

import itertools
import json

import httpx
import numpy as np
import pytest
from helpers.word_models import NATURAL_LINE, TOKENIZED_LINE

from txl_deploy.runtimes import TxlRuntime

pytest.importorskip("torch")

SEEDS = range(6)
N = 30
SAMPLING = {"temperature": 1.5, "max_tokens": N}


@pytest.fixture(scope="module")
def rt(wikitext_onnx):
    with TxlRuntime.load(wikitext_onnx, threads=1) as runtime:
        yield runtime


def _text(rt, seed, **controls):
    """What TxlRuntime writes after NATURAL_LINE: (text, token ids)."""
    rt.reset()
    ids = list(rt.generate(NATURAL_LINE, N, temperature=1.5, seed=seed, **controls))
    rt.reset()
    return "".join(rt.vocab.stream_decoder(NATURAL_LINE, context=rt.encode(NATURAL_LINE)).pieces(ids)), ids


def _check_ban_unk(url, rt):
    unk = rt.vocab.index["<unk>"]
    for seed in SEEDS[:3]:
        body = {"prompt": NATURAL_LINE, "seed": seed, "logit_bias": {str(unk): 100}, "return_token_ids": True,
                **SAMPLING}
        free = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert free["token_ids"] == [unk] * N  # what the model would write
        banned = httpx.post(url + "/v1/completions", json={**body, "ban_unk": True}, timeout=120).json()
        want, ids = _text(rt, seed, logit_bias={unk: 100}, ban_unk=True)
        assert banned["choices"][0]["token_ids"] == ids and unk not in ids
        assert banned["choices"][0]["text"] == want and "<unk>" not in want


def test_ban_unk_keeps_unk_out_of_completions(make_server, wikitext_onnx, rt):
    _check_ban_unk(make_server(model=wikitext_onnx).url, rt)


# -- detokenized text, streamed or not, and its offsets -----------------------------------------------------------
def _post(url, body):
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url, body):
    """The streamed chunks' choices, in order (the last one carries only the finish reason)."""
    choices = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices.append(json.loads(line[len("data: "):])["choices"][0])
    return choices


def test_completion_text_is_the_detokenized_tokens_streamed_or_not(make_server, wikitext_onnx, rt):
    url = make_server(model=wikitext_onnx).url
    vocab = rt.vocab
    assert vocab.tokenizer == "wikitext"
    prompt_ids = [int(i) for i in vocab.encode(NATURAL_LINE)]
    assert vocab.decode(prompt_ids) == NATURAL_LINE
    joined, stops_tried = "", 0
    for seed in SEEDS:
        body = {"prompt": NATURAL_LINE, "seed": seed, "return_token_ids": True, "logprobs": 2, **SAMPLING}
        choice = _post(url, body)["choices"][0]
        text, ids = choice["text"], choice["token_ids"]
        want, want_ids = _text(rt, seed)
        assert ids == want_ids  # the tokens TxlRuntime samples with that seed
        assert text == want
        # the completion continues the prompt's text: together they are the whole detokenized (where the completion
        # changes the prompt's last word, "year." then "@-@", what the prompt showed stays: the rest is sent)
        whole = vocab.decode(prompt_ids + ids)
        shared = next((k for k, (a, b) in enumerate(zip(NATURAL_LINE, whole)) if a != b), len(NATURAL_LINE))
        assert text == whole[shared:]
        # the text offsets run through the detokenized text: from 0, never back, never past its end
        offsets = choice["logprobs"]["text_offset"]
        assert len(offsets) == N and offsets[0] == 0
        assert all(a <= b for a, b in itertools.pairwise(offsets)) and offsets[-1] <= len(text)
        # streamed: the chunks join to the same text, and each chunk's text starts where its first token's offset
        # says (one chunk per token, or several tokens together for a slow reader)
        chunks = _stream(url, body)
        assert "".join(c["text"] for c in chunks) == text
        assert [t for c in chunks for t in c.get("token_ids") or []] == ids
        sent = 0
        for c in chunks:
            if c.get("logprobs"):
                assert c["logprobs"]["text_offset"][0] == sent
            sent += len(c["text"])
        assert [o for c in chunks if c.get("logprobs") for o in c["logprobs"]["text_offset"]] == offsets
        # a stop string is matched on the detokenized text, also where the detokenizer joined tokens ("1,0")
        join = next((k for k, ch in enumerate(text) if ch in ",-." and 0 < k < len(text) - 1), None)
        if join is not None:
            stop = text[join - 1:join + 2]
            stopped = _post(url, {**body, "stop": [stop]})["choices"][0]
            assert stopped["finish_reason"] == "stop" and stopped["text"] == text[:text.index(stop)]
            assert "".join(c["text"] for c in _stream(url, {**body, "stop": [stop]})) == stopped["text"]
            stops_tried += 1
        joined += text
    # the seeds tried wrote what the detokenizer has to join: number and dash markers, punctuation
    assert joined.count(",") > joined.count(" , ") and stops_tried >= len(SEEDS) // 2
    words = [vocab.symbols[i] for seed in SEEDS for i in _text(rt, seed)[1]]
    assert {"@-@", "@,@", ",", "."} <= set(words)


def test_a_natural_text_prompt_is_tokenized_as_wikitext_103_was(make_server, wikitext_onnx, rt):
    url = make_server(model=wikitext_onnx).url
    natural, tokenized = "it sold 1,000 copies.", "it sold 1 @,@ 000 copies ."
    ids = [rt.vocab.index[s] for s in tokenized.split()]
    body = {"seed": 2, "return_token_ids": True, "logprobs": 1, **SAMPLING}
    as_text = _post(url, {**body, "prompt": natural})
    as_ids = _post(url, {**body, "prompt": ids})
    assert as_text["usage"]["prompt_tokens"] == len(ids) == 7
    # the same memory: the same tokens, log-probs and text
    assert as_text["choices"][0]["token_ids"] == as_ids["choices"][0]["token_ids"]
    np.testing.assert_allclose(as_text["choices"][0]["logprobs"]["token_logprobs"],
                               as_ids["choices"][0]["logprobs"]["token_logprobs"], atol=1e-6)
    assert as_text["choices"][0]["text"] == as_ids["choices"][0]["text"]
    assert [rt.vocab.index[s] for s in TOKENIZED_LINE.split()] == [int(i) for i in rt.vocab.encode(NATURAL_LINE)]
