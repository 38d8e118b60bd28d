"""What `txl-deploy score` reads: texts to score, one a line, or JSON Lines naming each text's context and group.

Every line becomes a `ScoreItem` or a one-line error for that line alone (never an exception): a file from outside
may hold anything, and one bad line must not cost the others their scores. A line is read with a bounded buffer
(MAX_LINE_BYTES), so a file without line ends costs no more memory than one long line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

MAX_LINE_BYTES = 1 << 20  # one text with its context (a long document is ~100 kB); `score --help` says 1 MiB
FORMATS = ("auto", "text", "jsonl")
FIELDS = ("text", "context", "group", "id")


@dataclass(frozen=True)
class ScoreItem:
    """One text to score. `context`: text read before it, whose own tokens are not counted. `group`: hypotheses of
    one group share one context, read once (without a group, the items with the same context form one)."""

    text: str
    context: str | None = None
    group: str | int | None = None


@dataclass(frozen=True)
class InputLine:
    """Line `line` (1-based) of the input: its item, or why it has none; `id` is the line's own `id` field."""

    line: int
    item: ScoreItem | None = None
    error: str | None = None
    id: str | int | None = None


def read_lines(stream: BinaryIO) -> Iterator[tuple[int, bytes | None]]:
    """(line number, the line's bytes without its line end) for each line; None for a line over MAX_LINE_BYTES,
    which is skipped without being held."""
    number = 0
    while True:
        raw = stream.readline(MAX_LINE_BYTES + 1)
        if not raw:
            return
        number += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of the long line, a buffer at a time
                raw = stream.readline(MAX_LINE_BYTES)
            yield number, None
            continue
        yield number, raw.rstrip(b"\n").removesuffix(b"\r")


def sniff_format(lines: list[tuple[int, bytes | None]], name: str = "") -> str:
    """"jsonl" for a `.jsonl`/`.json` file or one whose first non-blank line starts with `{`, else "text"."""
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    for _, raw in lines:
        if raw is not None and raw.strip():
            return "jsonl" if raw.lstrip().startswith(b"{") else "text"
    return "text"


def parse_line(number: int, raw: bytes | None, fmt: str) -> InputLine:
    """One line of the input in format `fmt` ("text" or "jsonl") -> its item, or its error."""
    if raw is None:
        return InputLine(number, error=f"the line is longer than {MAX_LINE_BYTES:,} bytes")
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return InputLine(number, error=f"not UTF-8 text (byte {e.start}: {e.reason})")
    if fmt == "text":
        return InputLine(number, ScoreItem(line)) if line.strip() else InputLine(number, error="empty text")
    return _json_line(number, line)


def _json_line(number: int, line: str) -> InputLine:
    if not line.strip():
        return InputLine(number, error="empty line (expected a JSON object with a \"text\" field)")
    try:
        obj = json.loads(line)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        return InputLine(number, error=f"malformed JSON: {str(e)[:120]}")
    if not isinstance(obj, dict):
        return InputLine(number, error=f"expected a JSON object with a \"text\" field, got a {_json_type(obj)}")
    key = obj.get("id")
    key = key if _is_key(key) else None
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        return InputLine(number, error=f"unknown field {unknown[0][:40]!r} (fields: {', '.join(FIELDS)})", id=key)
    text, context, group = obj.get("text"), obj.get("context"), obj.get("group")
    if not isinstance(text, str):
        got = "no \"text\"" if "text" not in obj else f"a {_json_type(text)}"
        return InputLine(number, error=f"\"text\" must be a string, got {got}", id=key)
    if context is not None and not isinstance(context, str):
        return InputLine(number, error=f"\"context\" must be a string or null, got a {_json_type(context)}", id=key)
    for name, value in (("group", group), ("id", obj.get("id"))):
        if value is not None and not _is_key(value):
            return InputLine(number, error=f"\"{name}\" must be a string or an integer, got a {_json_type(value)}",
                             id=key)
    return InputLine(number, ScoreItem(text, context, group), id=key)


def _is_key(value) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def _json_type(value) -> str:
    for kind, name in ((bool, "boolean"), (int, "number"), (float, "number"), (str, "string"), (list, "list"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


def read_input(stream: BinaryIO, fmt: str = "auto", name: str = "") -> list[InputLine]:
    """Every line of `stream` (bytes), parsed as `fmt` ("auto": by `name`'s suffix, else the first line)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    lines = list(read_lines(stream))
    fmt = sniff_format(lines, name) if fmt == "auto" else fmt
    return [parse_line(number, raw, fmt) for number, raw in lines]
