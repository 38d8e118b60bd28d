"""`txl-deploy score` end to end: a text file or JSON Lines (a file or stdin) in, one JSON line per input line out
(a file written atomically and never overwritten without --force, or stdout), each bad line its own error, the
numbers those of `TxlRuntime.score_texts`, and --tokenizer as in eval."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.cli import assert_one_line_error, cli
from helpers.word_models import NATURAL_LINE, TOKENIZED_LINE

from txl_deploy.cli import main
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.score_input import ScoreItem


def records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def test_a_text_file_gives_a_line_per_line_and_keeps_what_exists(tiny_onnx, tmp_path):
    src, out = tmp_path / "hyps.txt", tmp_path / "scores.jsonl"
    src.write_text("w1 w2 w3\n\nw4 w5\r\n")
    result = cli("score", tiny_onnx, src, "-o", out, "--threads", "1")
    assert result.exit_code == 0, result.output
    assert "scored 2 texts (5 tokens)" in result.stderr and "1 lines with errors" in result.stderr
    got = records(out.read_text())
    assert [r["line"] for r in got] == [1, 2, 3] and got[1] == {"line": 2, "error": "empty text"}
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        expect = rt.score_texts(["w1 w2 w3", "w4 w5"])
    for r, e in zip((got[0], got[2]), expect):
        assert r["n_tokens"] == e["n_tokens"] and r["log_prob"] == pytest.approx(e["log_prob"], abs=1e-6)
    assert_one_line_error(cli("score", tiny_onnx, src, "-o", out), "exists")
    assert cli("score", tiny_onnx, src, "-o", out, "--force", "--line-end").exit_code == 0
    assert [r.get("n_tokens") for r in records(out.read_text())] == [4, None, 3]  # each <eos> counted too


def test_json_lines_from_stdin_with_groups_ids_and_bad_lines(tiny_onnx):
    lines = [json.dumps({"text": "w1 w2", "context": "w7 w8 w9", "group": "utt1", "id": "a"}),
             json.dumps({"text": "w3", "context": "w7 w8 w9", "group": "utt1", "id": "b"}),
             '{"text": "w4",', json.dumps(["w1"]), json.dumps({"text": "w5", "contxt": "w1"}),
             json.dumps({"text": "w6 w7", "id": 7})]
    data = ("\n".join(lines) + "\n").encode() + b"\xff\xfe bad bytes\n"
    result = CliRunner().invoke(main, ["score", str(tiny_onnx), "-", "--per-token", "--threads", "1"], input=data)
    assert result.exit_code == 0, result.output
    got = records(result.stdout)
    assert [r["line"] for r in got] == list(range(1, 8))
    assert [r.get("id") for r in got] == ["a", "b", None, None, None, 7, None]
    assert got[0]["group"] == got[1]["group"] == "utt1" and got[0]["tokens"] == ["w1", "w2"]
    assert got[2]["error"].startswith("malformed JSON") and "JSON object" in got[3]["error"]
    assert "unknown field 'contxt'" in got[4]["error"] and got[6]["error"].startswith("not UTF-8")
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        expect = rt.score_texts([ScoreItem("w1 w2", "w7 w8 w9"), ScoreItem("w3", "w7 w8 w9"), "w6 w7"],
                                per_token=True)
    for r, e in zip((got[0], got[1], got[5]), expect):
        assert r["token_log_probs"] == pytest.approx(e["token_log_probs"], abs=1e-6)


def test_the_tokenizer_option_splits_raw_text_as_in_eval(wikitext_onnx, tmp_path):
    src = tmp_path / "raw.txt"
    src.write_text(NATURAL_LINE + "\n")
    own = records(cli("score", wikitext_onnx, src, "--per-token", "--threads", "1").stdout)[0]
    assert own["tokens"] == TOKENIZED_LINE.split()  # the vocabulary's own: wikitext's Moses pipeline
    split = records(cli("score", wikitext_onnx, src, "--per-token", "--tokenizer", "whitespace").stdout)[0]
    assert split["tokens"] == [w if w in own["tokens"] else "<unk>" for w in NATURAL_LINE.split()]
