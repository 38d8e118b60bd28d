"""Reading `txl-deploy score`'s input: texts one a line or JSON Lines (chosen by the file's name or its first line),
Windows line ends, a line too long skipped without being held, and each bad line's error naming what is wrong."""

from __future__ import annotations

import io
import json

from txl_deploy.runtimes.score_input import MAX_LINE_BYTES, ScoreItem, read_input


def read(data: bytes, fmt="auto", name=""):
    return read_input(io.BytesIO(data), fmt, name)


def test_text_lines_and_their_format_chosen_by_name_or_first_line():
    lines = read(b"a b\r\n\n{not json}\nlast")
    assert [line.item for line in lines] == [ScoreItem("a b"), None, ScoreItem("{not json}"), ScoreItem("last")]
    assert lines[1].error == "empty text"
    assert read(b'\n  {"text": "x"}\n')[1].item == ScoreItem("x")  # a blank line, then an object: JSON Lines
    assert read(b'{"text": "x"}\n', "text")[0].item == ScoreItem('{"text": "x"}')
    assert read(b"x\n", name="hyps.jsonl")[0].error.startswith("malformed JSON")


def test_json_fields_and_their_errors():
    rows = [{"text": "t", "context": "c", "group": 3, "id": "u1"}, {"text": "t", "group": True},
            {"text": None}, {"context": "c"}, {"text": "t", "context": ["c"]}, {"text": "t", "id": 1.5}]
    lines = read("".join(json.dumps(r) + "\n" for r in rows).encode() + b"[" * 100_000 + b"\n")
    assert lines[0].item == ScoreItem("t", "c", 3) and lines[0].id == "u1"
    errors = [line.error for line in lines[1:]]
    assert errors[:5] == ['"group" must be a string or an integer, got a boolean', '"text" must be a string, got a null',
                          '"text" must be a string, got no "text"', '"context" must be a string or null, got a list',
                          '"id" must be a string or an integer, got a number']
    assert errors[5].startswith("malformed JSON")  # nested deeper than the parser's stack


def test_a_line_too_long_is_skipped_and_the_next_read():
    lines = read(b"x" * (MAX_LINE_BYTES + 10) + b"\nafter\n" + b"y" * MAX_LINE_BYTES, "text")
    assert "longer than 1,048,576 bytes" in lines[0].error
    assert lines[1].item == ScoreItem("after") and lines[2].item.text == "y" * MAX_LINE_BYTES
