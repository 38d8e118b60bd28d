"""Text to token ids, for each kind of vocabulary; and a whole corpus as the original preprocessing reads it.

The functions take a `Vocab` (its `symbols`, `index`, `unk`, `eos` and, for bytes, `byte_ids`). A symbol the
vocabulary lacks becomes `<unk>` where it has one, and is otherwise an `InputError` naming it.
"""

from __future__ import annotations

import numpy as np

from txl_deploy.errors import InputError
from txl_deploy.vocab import moses
from txl_deploy.vocab.kinds import LM1B_BOUNDARY, TEXT8_LETTERS, TEXT8_SPACE, byte_value

NEWLINE = 0x0A


def byte_tables(symbols) -> tuple[np.ndarray, list]:
    """(id of each byte value, -1 where the vocabulary lacks it; byte value of each id, None for <unk>/<eos>)."""
    ids = np.full(256, -1, dtype=np.int64)
    values = [byte_value(s) for s in symbols]
    for i, b in enumerate(values):
        if b is not None:
            ids[b] = i
    return ids, values


SHOWN_SYMBOLS = 16  # of a vocabulary, in an error about a symbol it lacks


def _unknown(vocab, problem: str) -> int:
    if vocab.unk is None:
        raise InputError(f"{problem}; {where_to_see(vocab)}")
    return vocab.index[vocab.unk]


def where_to_see(vocab) -> str:
    """The vocabulary's first symbols and how to list them all, for an error about a symbol it lacks."""
    first = ", ".join(repr(s) for s in vocab.symbols[:SHOWN_SYMBOLS])
    more = ", ..." if len(vocab.symbols) > SHOWN_SYMBOLS else ""
    return f"its {len(vocab.symbols):,} symbols are {first}{more} (`txl-deploy info MODEL --list-vocab` lists them all)"


def _lookup(vocab, piece: str, describe) -> int:
    i = vocab.index.get(piece)
    return _unknown(vocab, describe(piece)) if i is None else i


def utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"the text is not valid Unicode (character {e.start}: {e.reason})") from None


def encode_words(vocab, text: str, add_eos: bool | None) -> np.ndarray:
    """Words as the vocabulary's tokenizer splits each line (`whitespace`: on whitespace; `wikitext` / `lm1b`: the
    Moses pipelines of `moses.py`). A line closed by a newline ends in `<eos>` (as WikiText-103 was read); lm1b
    puts `<S>` before and after each closed line's words and before an unterminated last line's. `add_eos=False`
    leaves the line ends out (the newlines are then only word separators)."""
    add_eos = vocab.eos is not None if add_eos is None else add_eos
    lines = text.split("\n")
    if vocab.tokenizer == "lm1b":
        pieces = []
        for n, line in enumerate(lines):
            words = moses.tokenize_line(vocab, line)
            closed = n < len(lines) - 1
            if add_eos and (closed or words):
                pieces.extend([LM1B_BOUNDARY, *words] + ([LM1B_BOUNDARY] if closed else []))
            else:
                pieces.extend(words)
        return _word_ids(vocab, pieces)
    split = line_splitter(vocab)
    pieces = []
    for n, line in enumerate(lines):
        pieces.extend(split(line))
        # a trailing newline closes the last line; an unterminated last line gets no <eos>
        if add_eos and (n < len(lines) - 1):
            pieces.append(vocab.eos)
    return _word_ids(vocab, pieces)


def line_splitter(vocab):
    if vocab.tokenizer == "whitespace":
        return str.split
    return lambda line: moses.tokenize_line(vocab, line)


def _word_ids(vocab, pieces) -> np.ndarray:
    missing = (lambda p: f"symbol {p!r} is not in the vocabulary, which has no <unk>")
    return np.array([_lookup(vocab, p, missing) for p in pieces], dtype=np.int64)


def encode_pretokenized(vocab, text: str) -> np.ndarray:
    """A word corpus file as the original data pipeline read it (WikiText-103 and One Billion Word are distributed
    already tokenized): each line split on whitespace, `<eos>` after it (lm1b: `<S>` before and after it, empty
    lines too, as `add_double_eos`). A last line without its newline is read as a line all the same."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    pieces = []
    for line in lines:
        if vocab.tokenizer == "lm1b":
            pieces.extend([LM1B_BOUNDARY, *line.split(), LM1B_BOUNDARY])
        else:
            pieces.extend(line.split())
            if vocab.eos is not None:
                pieces.append(vocab.eos)
    return _word_ids(vocab, pieces)


def encode_chars(vocab, text: str) -> np.ndarray:
    missing = (lambda p: f"symbol {p!r} is not in the vocabulary, which has no <unk>")
    return np.array([_lookup(vocab, c, missing) for c in text], dtype=np.int64)


def event_lines(text: str) -> list[str]:
    """The events of a text written one a line: each line whole (REMI's events hold spaces), surrounding whitespace
    stripped (a `\r` of Windows line ends too); blank lines and a final line end are skipped."""
    return [line.strip() for line in text.split("\n") if line.strip()]


def encode_events(vocab, events) -> np.ndarray:
    """Event symbols, each looked up whole (never split), -> ids; an event the vocabulary lacks is `<unk>` where it
    has one, else an InputError naming it and its position."""
    if isinstance(events, str):
        raise InputError("events must be a list of event symbols (a str is text: pass it to encode, one event a line)")
    ids = []
    for n, event in enumerate(events, 1):
        if not isinstance(event, str):
            raise InputError(f"event {n} is a {type(event).__name__}, not an event symbol (text)")
        ids.append(_lookup(vocab, event, lambda e, n=n: f"event {n} ({e[:80]!r}) is not in the vocabulary"))
    return np.array(ids, dtype=np.int64)


def encode_text8(vocab, text: str) -> np.ndarray:
    """A space is `_`; other whitespace (newlines, tabs) is dropped, as the original tokenizer drops it, or a
    newline is `<eos>` where the vocabulary has one. Anything else must be one of the vocabulary's letters: a
    literal `_` too, which text8 cannot hold (its `_` is the space)."""
    held = "".join(sorted(s for s in vocab.symbols if s in TEXT8_LETTERS))
    what = "lowercase a-z" if held == TEXT8_LETTERS else f"the letters {held}"
    spaces = " and spaces" if TEXT8_SPACE in vocab.index else ""

    def missing(c):
        return (f"character {c!r} is not in this text8 vocabulary, which holds {what}{spaces} only (text8 is "
                "lowercase letters and spaces) and has no <unk>")

    ids = []
    for c in text:
        if c == " ":
            ids.append(_lookup(vocab, TEXT8_SPACE, lambda _: missing(" ")))
        elif c.isspace():
            if c == "\n" and vocab.eos is not None:
                ids.append(vocab.index[vocab.eos])
        elif c == TEXT8_SPACE:
            ids.append(_unknown(vocab, missing(c)))
        else:
            ids.append(_lookup(vocab, c, missing))
    return np.array(ids, dtype=np.int64)


def newline_handling(vocab) -> str:
    """What a newline byte becomes: "symbol" (the vocabulary holds byte 10), "<eos>", or "dropped" (the paper's
    enwik8 vocabulary, whose preprocessing removed every newline)."""
    if vocab.byte_ids[NEWLINE] >= 0:
        return "symbol"
    return "<eos>" if vocab.eos is not None else "dropped"


def encode_bytes(vocab, data: bytes) -> np.ndarray:
    """Each byte is its decimal symbol; a newline is dropped unless the vocabulary holds it (or `<eos>`)."""
    data = bytes(data)
    raw = np.frombuffer(data, dtype=np.uint8)
    ids = vocab.byte_ids[raw]
    at = np.arange(raw.size)
    newlines = newline_handling(vocab)
    if newlines == "<eos>":
        ids[raw == NEWLINE] = vocab.index[vocab.eos]
    elif newlines == "dropped":
        keep = raw != NEWLINE
        ids, at = ids[keep], at[keep]
    lacking = ids < 0
    if lacking.any():
        if vocab.unk is None:
            first = int(at[int(np.argmax(lacking))])
            raise InputError(_missing_byte(data, first, int(raw[first]), vocab))
        ids[lacking] = vocab.index[vocab.unk]
    return ids


def _missing_byte(data: bytes, at: int, value: int, vocab) -> str:
    held = int((vocab.byte_ids >= 0).sum())
    return (f"byte {value} (0x{value:02x}, {_character_at(data, at)} at byte {at}) is not in this model's byte "
            f"vocabulary, which has no <unk>: it holds {held} of the 256 byte values (those its training text had); "
            "`txl-deploy info MODEL --list-vocab` lists them")


def _character_at(data: bytes, at: int) -> str:
    """The character the byte at `at` belongs to, for an error message."""
    for start in range(at, max(-1, at - 4), -1):
        for end in range(at + 1, min(len(data), start + 4) + 1):
            try:
                char = data[start:end].decode("utf-8")
            except UnicodeDecodeError:
                continue
            if len(char) == 1:
                return f"of {char!r}"
    return "in an invalid UTF-8 sequence"


def decode_utf8_text(data: bytes) -> str:
    """Bytes of a text file as Python's text mode reads them: UTF-8, with universal newlines."""
    try:
        text = bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"not UTF-8 text (byte {e.start}: {e.reason})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def encode_corpus(vocab, data, raw: bool = False) -> tuple[np.ndarray, dict]:
    """Token ids of a whole text (str, or the file's bytes) as the original preprocessing of the model's corpus
    reads it, and what was counted on the way (`input`, reported beside an evaluation's score).

    bytes: the raw bytes (a str is encoded as UTF-8), newlines dropped (prep_enwik8.py + data_utils.py).
    text8: leading and trailing whitespace stripped (prep_text8.py's `strip()`), then as `encode`.
    char, events: as `encode` (events: one a line).
    word: a pre-tokenized corpus file, as the original data pipeline read it (`encode_pretokenized`), whatever the
    vocabulary's tokenizer; `raw=True` reads raw text with the vocabulary's tokenizer instead (as `encode`)."""
    if vocab.kind == "bytes":
        if isinstance(data, str):
            data = utf8(data)
        ids = encode_bytes(vocab, data)
        counts = {"raw_bytes": len(data), "newlines": bytes(data).count(b"\n"),
                  "newlines_are": newline_handling(vocab), "symbols": int(ids.size)}
        return ids, counts
    text = data if isinstance(data, str) else decode_utf8_text(data)
    if vocab.kind == "text8":
        stripped = text.strip()
        ids = encode_text8(vocab, stripped)
        return ids, {"characters": len(text), "stripped": len(text) - len(stripped), "symbols": int(ids.size)}
    if vocab.kind in ("char", "events"):
        ids = vocab.encode(text)
        return ids, {"characters": len(text), "symbols": int(ids.size)}
    ids = vocab.encode(text) if raw else encode_pretokenized(vocab, text)
    line_ends = "<S> before and after each line" if vocab.tokenizer == "lm1b" else "<eos> line ends"
    read_as = (f"raw text tokenized with the {vocab.tokenizer} tokenizer" if raw and vocab.tokenizer != "whitespace"
               else "a pre-tokenized corpus: each line split on whitespace")
    return ids, {"characters": len(text), "symbols": int(ids.size), "line_ends": line_ends, "read_as": read_as}


def counting(kind: str, counts: dict, scored: int) -> str:
    """One sentence saying exactly what an evaluation's score is per (for the result and the command line)."""
    if kind == "bytes":
        if counts["newlines_are"] != "dropped":
            return (f"bits per byte over {scored:,} bytes predicted: the text's {counts['raw_bytes']:,} UTF-8 bytes "
                    f"(its {counts['newlines']:,} newlines as {counts['newlines_are']}) less the first (nothing "
                    "precedes it)")
        return (f"bits per byte over {scored:,} bytes predicted: the text's {counts['raw_bytes']:,} UTF-8 bytes, less "
                f"its {counts['newlines']:,} newline bytes (dropped by the original enwik8 preprocessing, so never "
                "predicted) and the first byte (nothing precedes it)")
    if kind == "text8":
        return (f"bits per character over {scored:,} characters predicted: the text with {counts['stripped']:,} "
                "leading/trailing whitespace characters stripped and other non-space whitespace dropped (as "
                "prep_text8.py and the original tokenizer do), spaces counted, less the first character")
    if kind == "char":
        return f"bits per character over {scored:,} characters predicted (every character after the first)"
    if kind == "events":
        return f"perplexity over {scored:,} events predicted (one a line, every event after the first)"
    line_ends = counts.get("line_ends", "<eos> line ends")
    read_as = f"; the text read as {counts['read_as']}" if "read_as" in counts else ""
    return f"perplexity over {scored:,} tokens predicted (words and {line_ends}, after the first{read_as})"

