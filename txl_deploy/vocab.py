"""The symbol list a model was trained with: encodes text to token ids and back. No torch, never unpickled.

Two kinds, as in the published models:
- `word`: whitespace-separated words, `<eos>` at every line end, unknown words map to `<unk>` (WikiText-103);
- `char`: one symbol per character; newlines are ordinary symbols (enwik8 / text8 style, and our demo model).

It travels with the model as JSON (`{"kind": ..., "symbols": [...]}`) in our checkpoint folder and in the ONNX
metadata. `Vocab.read` also takes the original code's one-symbol-a-line `vocab.txt` (the first whitespace field
of each line, as the original `Vocab.build_vocab` reads it) and a plain character list.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from txl_deploy.errors import CheckpointError, InputError

KINDS = ("word", "char")


class Vocab:
    def __init__(self, symbols, kind="word", unk="<unk>", eos="<eos>"):
        if kind not in KINDS:
            raise ValueError(f"vocabulary kind must be one of {KINDS}, got {kind!r}")
        self.symbols = list(symbols)
        if len(set(self.symbols)) != len(self.symbols):
            dup = next(s for s in self.symbols if self.symbols.count(s) > 1)
            raise ValueError(f"vocabulary has a duplicate symbol {dup!r}")
        self.kind = kind
        self.index = {s: i for i, s in enumerate(self.symbols)}
        self.unk = unk if unk in self.index else None
        self.eos = eos if eos in self.index else None

    def __len__(self):
        return len(self.symbols)

    def __eq__(self, other):
        return isinstance(other, Vocab) and (self.kind, self.symbols) == (other.kind, other.symbols)

    # -- text <-> ids ------------------------------------------------------------------------------------
    def encode(self, text: str, add_eos: bool | None = None) -> np.ndarray:
        """Text -> int64 ids. Word vocabularies add `<eos>` at each line end (as WikiText-103 was read)."""
        if self.kind == "char":
            pieces = list(text)
        else:
            add_eos = self.eos is not None if add_eos is None else add_eos
            pieces = []
            lines = text.split("\n")
            for n, line in enumerate(lines):
                pieces.extend(line.split())
                # a trailing newline closes the last line; an unterminated last line gets <eos> only if asked
                if add_eos and (n < len(lines) - 1):
                    pieces.append(self.eos)
        ids = np.empty(len(pieces), dtype=np.int64)
        for n, piece in enumerate(pieces):
            i = self.index.get(piece)
            if i is None:
                if self.unk is None:
                    raise InputError(f"symbol {piece!r} is not in the vocabulary, which has no <unk>")
                i = self.index[self.unk]
            ids[n] = i
        return ids

    def decode(self, ids) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < len(self.symbols)]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {len(self.symbols)})")
        if self.kind == "char":
            return "".join(self.symbols[i] for i in ids)
        out = []
        for i in ids:
            s = self.symbols[i]
            out.append("\n" if s == self.eos else s)
        text = " ".join(out)
        return text.replace(" \n ", "\n").replace(" \n", "\n").replace("\n ", "\n")

    def piece(self, i: int) -> str:
        """Text for one generated token as it continues a stream: words get a leading space, <eos> a newline."""
        text = self.decode([i])
        return text if self.kind == "char" or text == "\n" else " " + text

    # -- files ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"kind": self.kind, "symbols": self.symbols}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Vocab":
        return cls(d["symbols"], kind=d.get("kind", "word"))

    def save(self, path):
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def read(cls, path, kind: str | None = None) -> "Vocab":
        """Read our vocab.json, the original one-symbol-a-line vocab.txt, or a character list file."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CheckpointError(path, "vocabulary file not found") from None
        except UnicodeDecodeError:
            raise CheckpointError(path, "vocabulary is not UTF-8 text") from None
        if path.suffix == ".json":
            try:
                d = json.loads(text)
                if isinstance(d, list):
                    return cls(d, kind=kind or "char")
                return cls.from_dict(d)
            except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested too deep
                raise CheckpointError(path, f"not a vocabulary JSON ({type(e).__name__}: {str(e)[:200]})") from None
        if kind == "char":
            # a character list: one character per line, or all characters on one line
            lines = text.split("\n")
            if len(lines) > 1 and all(len(line) <= 1 for line in lines[:-1]):
                return cls([("\n" if line == "" else line) for line in lines[:-1]], kind="char")
            return cls(list(text.rstrip("\n")), kind="char")
        symbols = [line.strip().split()[0] for line in text.splitlines() if line.strip()]
        if not symbols:
            raise CheckpointError(path, "vocabulary file is empty")
        try:
            return cls(symbols, kind=kind or "word")
        except ValueError as e:
            raise CheckpointError(path, str(e)) from None
