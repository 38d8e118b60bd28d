"""txl.js's `Vocab` and `StreamDecoder` (what the browser page runs) against txl_deploy.vocab, kind by kind: the same
ids for the same text, the same pieces for the same stream of ids (invalid UTF-8 included), the same refusals.
Runs the file under Node.js (its TextEncoder/TextDecoder are the WHATWG ones browsers have); the page itself is
tested in Chromium by tests/test_web.py and tests/serving/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from helpers.page_modules import page_modules

from txl_deploy.vocab import Vocab

NODE = shutil.which("node") or shutil.which("nodejs")
pytestmark = pytest.mark.skipif(NODE is None and os.environ.get("TXL_WEB_TESTS") != "required",
                                reason="no Node.js (apt-get install nodejs)")

RUNNER = """
import { Vocab } from "./txl.js";
import { readFileSync } from "node:fs";
const cases = JSON.parse(readFileSync(process.argv[2], "utf8"));
const out = cases.map(({ vocab, encode, ids, after }) => {
  let v;
  try { v = new Vocab(vocab); } catch (e) { return { error: e.message }; }
  const encoded = encode.map((text) => { try { return v.encode(text); } catch (e) { return e.message; } });
  const decoder = v.streamDecoder(after);
  return { encoded, pieces: [...ids.map((id) => decoder.feed(id)), decoder.flush()], representation: v.representation };
});
console.log(JSON.stringify(out));
"""


def run_js(tmp_path, cases):
    assert NODE is not None, "no Node.js (TXL_WEB_TESTS=required)"
    page_modules(tmp_path)
    (tmp_path / "run.mjs").write_text(RUNNER)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    r = subprocess.run([NODE, "run.mjs", "cases.json"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def python_side(vocab: Vocab, encode, ids, after):
    encoded = []
    for text in encode:
        try:
            encoded.append(vocab.encode(text).tolist())
        except ValueError as e:
            encoded.append(str(e))
    decoder = vocab.stream_decoder(after)
    return encoded, [decoder.feed(i) for i in ids] + [decoder.flush()]


def test_every_kind_reads_and_writes_text_as_python_does(tmp_path):
    rng = np.random.default_rng(0)
    enwik8 = Vocab(list(rng.permutation([str(b) for b in range(256) if b != 10])), kind="bytes")
    special_bytes = Vocab([str(b) for b in b"abc\xc3\xa9\xe2\x82\xac"] + ["<unk>", "<eos>"], kind="bytes")
    text8 = Vocab(list("_etaoinsrhldcumfpgwybvkxjqz"), kind="text8")
    words = Vocab(["<eos>", "<unk>", "the", "cat", "sat"])
    chars = Vocab(list("ab\n_ é"), kind="char")
    events = Vocab(["Bar_None", "Position_1/16", "Note On_60", "Chord_C:maj", "<unk>"], kind="events")
    remi = Vocab(["Bar_None", "Position_1/16", "Note On_60", "Chord_C:maj"], kind="events", representation="remi")
    cases = []
    for vocab, encode, ids, after in (
        (enwik8, ["Zürich — 東京 ✓ 🎉", "line\nbreak"],
         [int(enwik8.byte_ids[b]) for b in rng.integers(0, 256, 300) if b != 10], ""),
        (enwik8, [], [int(enwik8.byte_ids[b]) for b in b"\xe2\x82a\xc3\xc3\xa9\xf0\x9f\x8e \xed\xa0\x80\xbc"], ""),
        (special_bytes, ["abé€\nx"], [0, 3, 9, 4, 8, 5, 6, 7, 3], ""),
        (text8, ["the quick fox", "The", "a_b", "one\ttwo\nthree"], [3, 9, 0, 2, 0, 26, 1], ""),
        (words, ["the cat\nsat\n", "the dog"], [2, 3, 0, 0, 4, 2, 0, 3], "the"),
        (chars, ["a_ b\né"], [0, 3, 4, 2, 5, 1], ""),
        (events, ["Bar_None\nNote On_60\n\n Chord_C:maj \r\n", "Note On_61"], [0, 1, 2, 4, 3], "Bar_None"),
        (remi, ["Bar_None\nPosition_1/16\n", "Bar_None\nNote On_61\n"], [0, 1, 2, 3], ""),
    ):
        cases.append({"vocab": vocab.to_dict(), "encode": encode, "ids": ids, "after": after})
    results = run_js(tmp_path, cases)
    vocabs = [enwik8, enwik8, special_bytes, text8, words, chars, events, remi]
    for case, vocab, got in zip(cases, vocabs, results):
        encoded, pieces = python_side(vocab, case["encode"], case["ids"], case["after"])
        assert got["pieces"] == pieces, vocab.kind
        assert got["representation"] == vocab.representation
        for js, py in zip(got["encoded"], encoded):
            if isinstance(py, str):  # a refusal: both name the same character
                assert isinstance(js, str) and py.split(" is not")[0] == js.replace('"', "'").split(" is not")[0]
            else:
                assert js == py, vocab.kind


def test_an_unknown_kind_is_refused(tmp_path):
    got = run_js(tmp_path, [{"vocab": {"kind": "bpe", "symbols": ["a"]}, "encode": [], "ids": [], "after": ""}])
    assert got == [{"error": 'vocabulary kind "bpe" is not one this txl.js knows (word, char, bytes, text8, events)'}]
