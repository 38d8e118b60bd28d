"""The HTTP server writes a byte-level (enwik8) model's text as the other paths do: UTF-8 characters whole, streamed
or not, from the vocabulary's incremental decoder."""

from __future__ import annotations

import json

import httpx
from helpers import character_corpora as cc

PROMPT = "naïve a"
N = 24  # ends on the first byte of 日: only the very end of the text is U+FFFD


def test_completion_text_of_a_byte_model_is_valid_utf8_streamed_or_not(make_server, tf_enwik8_onnx, enwik8_cycle):
    want = cc.greedy_bytes_text(enwik8_cycle[1], PROMPT, N)
    assert any(ord(c) > 127 for c in want[:-1]) and want.index("\ufffd") == len(want) - 1
    srv = make_server(model=tf_enwik8_onnx)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == want
    pieces = []
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[len("data: "):])["choices"][0]["text"])
    assert "".join(pieces) == want
    # a character spelled over several bytes is sent once whole, never as a replacement character per byte
    sent = [p for p in pieces if p]  # the last chunk may carry only the finish reason
    assert not any("\ufffd" in p for p in sent[:-1]) and sent[-1].endswith("\ufffd")
