"""The symbol list a model was trained with, and its kind: encodes text to token ids and back. Never unpickled.

It travels with the model as JSON (`{"kind": ..., "symbols": [...]}`, and an events vocabulary's
`"representation"`) in our checkpoint folder, the ONNX metadata and every file made from them; a kind this version
does not know is an error (`UnknownKindError`), never read as another. `Vocab.read` also takes the original code's
one-symbol-a-line `vocab.txt` (the first whitespace field of each line, as the original `Vocab.build_vocab` reads
it; with kind `events`, each whole line), and a plain character list; the kinds are in `kinds.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.vocab import encode as enc
from txl_deploy.vocab import moses
from txl_deploy.vocab.kinds import (
    DESCRIPTIONS,
    EOS,
    KINDS,
    LM1B_BOUNDARY,
    LM1B_UNK,
    TOKENIZERS,
    UNK,
    UnknownKindError,
    choose_kind,
    detect_tokenizer,
    misfit,
)
from txl_deploy.vocab.stream import StreamDecoder
from txl_deploy.vocab.symbols import SymbolIndex, SymbolTable


class Vocab:
    """A model's symbols and how text maps to them.

    `tokenizer` (word vocabularies only; see `kinds.TOKENIZERS`): how text is split into words and joined again;
    None picks the one the symbols show (`kinds.detect_tokenizer`). `lower_case`, `delimiter` and `never_split`
    are HuggingFace TransfoXLTokenizer's settings as its vocab.pkl stores them: lower-case the text first; `""`
    reads a line as characters instead of running the Moses pipeline (None: the pipeline); symbols the Moses
    tokenizer keeps whole. `unk` / `eos` name the unknown-word and line-end symbols; a vocabulary without `<unk>`
    but with `<UNK>` (One Billion Word) uses `<UNK>`, and an lm1b vocabulary without `<eos>` ends lines with `<S>`.
    `representation` (events vocabularies only): the name of the music representation its events are written in
    (`remi`, `remi-xl`; txl_deploy.music.representation), None when they are no representation we write as MIDI.
    """

    def __init__(self, symbols, kind="word", unk=UNK, eos=EOS, tokenizer=None, lower_case=False, delimiter=None,
                 never_split=(), representation=None):
        if kind not in KINDS:
            raise UnknownKindError(kind)
        given = symbols if isinstance(symbols, (list, tuple)) else list(symbols)  # read once as plain strings
        # Held as a SymbolTable and SymbolIndex (a list and a dict cost a 267,735-word vocabulary 40 MB, these 8)
        self.symbols = SymbolTable(given)
        self.index = SymbolIndex(self.symbols, given)  # refuses a duplicate symbol
        problem = misfit(kind, given)
        if problem:
            raise ValueError(f"not a {kind} vocabulary: {problem}")
        self.kind = kind
        if kind == "word":
            tokenizer = detect_tokenizer(given) if tokenizer is None else tokenizer
            if tokenizer not in TOKENIZERS:
                raise ValueError(f"tokenizer {tokenizer!r} is not one of {', '.join(TOKENIZERS)}")
        elif tokenizer is not None:
            raise ValueError(f"a {kind} vocabulary has no word tokenizer (got {tokenizer!r})")
        if delimiter is not None and not isinstance(delimiter, str):
            raise ValueError(f"delimiter must be a string or None, got {type(delimiter).__name__}")
        self.tokenizer = tokenizer
        self.lower_case = bool(lower_case)
        self.delimiter = delimiter
        self.never_split = tuple(str(s) for s in never_split)
        if representation is not None and (kind != "events" or not isinstance(representation, str)):
            raise ValueError(f"only an events vocabulary names a music representation (a name), not a {kind} "
                             f"vocabulary (got {str(representation)[:40]!r})")
        self.representation = representation
        # the One Billion Word vocabulary spells its unknown word <UNK> and has no <eos> (its lines end in <S>)
        if unk == UNK and unk not in self.index and LM1B_UNK in self.index:
            unk = LM1B_UNK
        if eos == EOS and eos not in self.index and tokenizer == "lm1b" and LM1B_BOUNDARY in self.index:
            eos = LM1B_BOUNDARY
        if kind == "events":  # line ends separate events: no symbol stands for them
            eos = None
        self.unk = unk if unk in self.index else None
        self.eos = eos if eos in self.index else None
        self._moses = None  # the sacremoses objects, built on first use (slow to build)
        self._quotes = None  # its symbols the Moses detokenizer counts as quotes (moses.quote_symbols)
        if kind == "bytes":
            self.byte_ids, self.byte_of = enc.byte_tables(given)

    def _settings(self):
        return (self.kind, self.tokenizer, self.lower_case, self.delimiter, self.never_split, self.representation)

    def __len__(self):
        return len(self.symbols)

    def __eq__(self, other):
        return (isinstance(other, Vocab) and self._settings() == other._settings()
                and (self.symbols, self.unk, self.eos) == (other.symbols, other.unk, other.eos))

    __hash__ = None  # mutable symbol list: equal vocabularies need not hash alike

    def __repr__(self):
        extra = "" if self.tokenizer is None else f", tokenizer={self.tokenizer!r}"
        extra += ", lower_case=True" if self.lower_case else ""
        extra += "" if self.delimiter is None else f", delimiter={self.delimiter!r}"
        extra += f", never_split={list(self.never_split)!r}" if self.never_split else ""
        extra += "" if self.representation is None else f", representation={self.representation!r}"
        return f"Vocab({len(self.symbols)} symbols, kind={self.kind!r}{extra})"

    @property
    def description(self) -> str:
        return DESCRIPTIONS[self.kind]

    def with_kind(self, kind: str) -> Vocab:
        """The same symbols read as another kind (ValueError if they cannot be that kind)."""
        if kind == self.kind:
            return self
        return Vocab(self.symbols, kind=kind, **(self._word_settings() if kind == "word" else {}))

    def with_representation(self, representation: str | None) -> Vocab:
        """The same events vocabulary naming another music representation (None: none)."""
        if self.kind != "events":
            raise ValueError(f"a {self.kind} vocabulary names no music representation (only an events one does)")
        if representation == self.representation:
            return self
        return Vocab(self.symbols, kind="events", unk=self.unk or UNK, representation=representation)

    def with_tokenizer(self, tokenizer: str) -> Vocab:
        """The same word vocabulary read and written with another tokenizer (one of `TOKENIZERS`)."""
        if self.kind != "word":
            raise ValueError(f"a {self.kind} vocabulary has no word tokenizer to change")
        if tokenizer == self.tokenizer:
            return self
        return Vocab(self.symbols, kind="word", **dict(self._word_settings(), tokenizer=tokenizer))

    def _word_settings(self) -> dict:
        return {"tokenizer": self.tokenizer, "lower_case": self.lower_case, "delimiter": self.delimiter,
                "never_split": self.never_split}

    # -- text <-> ids ------------------------------------------------------------------------------------
    def encode(self, text: str, add_eos: bool | None = None) -> np.ndarray:
        """Text -> int64 ids. Word vocabularies add `<eos>` at each line end (as WikiText-103 was read); byte
        vocabularies encode the UTF-8 bytes and drop newlines (as the enwik8 preprocessing did); text8 reads a
        space as `_`. A symbol the vocabulary lacks is `<unk>`, or an InputError naming it."""
        if not isinstance(text, str):
            raise InputError(f"text must be a str, got {type(text).__name__}")
        if self.kind == "char":
            return enc.encode_chars(self, text)
        if self.kind == "bytes":
            return enc.encode_bytes(self, enc.utf8(text))
        if self.kind == "text8":
            return enc.encode_text8(self, text)
        if self.kind == "events":
            return enc.encode_events(self, enc.event_lines(text))
        return enc.encode_words(self, text, add_eos)

    def encode_events(self, events) -> np.ndarray:
        """A list of event symbols (each verbatim, e.g. `Note On_60`) -> int64 ids, for an events vocabulary."""
        if self.kind != "events":
            raise InputError(f"encode_events is for events vocabularies; this one is of kind {self.kind}")
        return enc.encode_events(self, events)

    def events(self, ids) -> list[str]:
        """Token ids -> their event symbols, verbatim (an events vocabulary; `decode` gives them one a line)."""
        return [self.symbols[i] for i in self._checked(ids)]

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes -> ids, for a byte vocabulary (any bytes: a split of enwik8 need not be whole UTF-8)."""
        if self.kind != "bytes":
            raise InputError(f"encode_bytes is for byte vocabularies; this one is of kind {self.kind}")
        return enc.encode_bytes(self, data)

    def encode_corpus(self, data, raw: bool = False) -> tuple[np.ndarray, dict]:
        """Ids of a whole text (str or the bytes of a file) as the original preprocessing of the model's corpus
        read it, and what was counted (see `encode.encode_corpus`). What `txl-deploy eval` scores. A word corpus
        is read as the pre-tokenized file it is distributed as (whitespace, a line end per line); `raw=True`
        tokenizes raw text with the vocabulary's tokenizer instead (e.g. `vocab.with_tokenizer("wikitext")`)."""
        return enc.encode_corpus(self, data, raw=raw)

    def _checked(self, ids) -> list[int]:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        bad = [i for i in ids if not 0 <= i < len(self.symbols)]
        if bad:
            raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {len(self.symbols)})")
        return ids

    def decode(self, ids) -> str:
        """Token ids -> text (an events vocabulary: each event on its own line, each line ended)."""
        ids = self._checked(ids)
        if self.kind == "events":
            return "".join(self.symbols[i] + "\n" for i in ids)
        if self.kind == "char":
            return "".join(self.symbols[i] for i in ids)
        if self.kind in ("bytes", "text8"):
            decoder = self.stream_decoder()
            return "".join(decoder.feed(i) for i in ids) + decoder.flush()
        if self.tokenizer != "whitespace":
            return moses.decode_words(self, [self.symbols[i] for i in ids])
        out = []
        for i in ids:
            s = self.symbols[i]
            out.append("\n" if s == self.eos else s)
        text = " ".join(out)
        return text.replace(" \n ", "\n").replace(" \n", "\n").replace("\n ", "\n")

    def stream_decoder(self, after: str = "", context=None) -> StreamDecoder:
        """An incremental decoder for generated ids: `feed(id)` returns the text that can be printed now (a
        character split over byte tokens comes out whole, once complete; invalid bytes are U+FFFD; a Moses word
        once no later word can change it), `flush()` the rest at the end. `after`: the text the stream continues
        (a prompt), which decides whether a word's leading space is needed; `CONTINUING` for text it was not
        shown. `context`: the ids of that text (wikitext/lm1b: detokenizes the continued line exactly)."""
        return StreamDecoder(self, after, context=context)

    def piece(self, i: int) -> str:
        """Text for one generated token as it continues a stream: words get a leading space, <eos> a newline.
        Only whole symbols: for byte vocabularies (a character over several tokens) use `stream_decoder()`."""
        text = self.decode([i])
        return text if self.kind != "word" or text == "\n" else " " + text

    # -- files ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The vocabulary as JSON: kind, symbols and, for a word vocabulary, its tokenizer (with HuggingFace's
        settings where they are not the defaults)."""
        d = {"kind": self.kind, "symbols": list(self.symbols)}
        if self.tokenizer is not None:
            d["tokenizer"] = self.tokenizer
        if self.lower_case:
            d["lower_case"] = True
        if self.delimiter is not None:
            d["delimiter"] = self.delimiter
        if self.never_split:
            d["never_split"] = list(self.never_split)
        if self.representation is not None:
            d["representation"] = self.representation
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict) -> Vocab:
        """Read `to_dict`'s dict; one written before vocabularies recorded their tokenizer gets the one its symbols
        show."""
        if not isinstance(d, dict):
            raise TypeError(f"a vocabulary is a JSON object, got {type(d).__name__}")
        never_split = d.get("never_split", ())
        if not isinstance(never_split, (list, tuple)):
            raise TypeError(f"never_split must be a list of symbols, got {type(never_split).__name__}")
        return cls(d["symbols"], kind=d.get("kind", "word"), tokenizer=d.get("tokenizer"),
                   lower_case=d.get("lower_case", False) is True, delimiter=d.get("delimiter"),
                   never_split=never_split, representation=d.get("representation"))

    def save(self, path):
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def read(cls, path, kind: str | None = None, are_events=None) -> Vocab:
        """Read our vocab.json, the original one-symbol-a-line vocab.txt, or a character list file.

        `kind`: what the user says the vocabulary is (it overrides our vocab.json's). Otherwise a vocab.txt or a
        JSON list is `bytes` or `text8` when its symbols show it (see `kinds.detect_kind`), else `word` (a
        vocab.txt) or `char` (a JSON list). `are_events(lines)`: whether a text file's whole lines are a music
        representation's events (music.representation, a layer above this one); then it is read as `events`,
        verbatim, since a word vocabulary keeps only each line's first field (`Note On_60` would be `Note`)."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CheckpointError(path, "vocabulary file not found") from None
        except UnicodeDecodeError:
            raise CheckpointError(path, "vocabulary is not UTF-8 text") from None
        try:
            if path.suffix == ".json":
                try:
                    d = json.loads(text)
                    if isinstance(d, list):
                        return cls(d, kind=choose_kind(d, kind, default="char"))
                    vocab = cls.from_dict(d)
                except UnknownKindError:
                    raise
                except (ValueError, KeyError, TypeError, RecursionError) as e:  # RecursionError: nested too deep
                    raise CheckpointError(path, f"not a vocabulary JSON ({type(e).__name__}: {str(e)[:200]})") \
                        from None
                return vocab if kind is None else vocab.with_kind(choose_kind(vocab.symbols, kind))
            if kind == "events":  # one event a line, verbatim: events hold spaces (REMI's `Note On_60`)
                return cls(event_file_lines(text, path), kind="events")
            if kind == "char":
                # a character list: one character per line, or all characters on one line
                lines = text.split("\n")
                if len(lines) > 1 and all(len(line) <= 1 for line in lines[:-1]):
                    return cls([("\n" if line == "" else line) for line in lines[:-1]], kind="char")
                return cls(list(text.rstrip("\n")), kind="char")
            symbols = symbols_of_lines(text, path)
            if kind is None and are_events is not None:
                lines = event_file_lines(text, path)
                if are_events(lines):
                    return cls(lines, kind="events")
            return cls(symbols, kind=choose_kind(symbols, kind))
        except UnknownKindError as e:
            raise CheckpointError(path, str(e)) from None
        except ValueError as e:
            raise CheckpointError(path, str(e)) from None


def symbols_of_lines(text: str, path) -> list[str]:
    """A one-symbol-a-line file's symbols, the first whitespace field of each line, as the original `Vocab`
    reads them: lines end at `\n` only (`str.splitlines` also ends them at `\x85`, `\u2028` or `\x1c`, and a
    symbol holding one would shift every later id). Blank lines at the end are ignored; one before a symbol is
    refused, since skipping it would shift the ids as well."""
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise CheckpointError(path, "vocabulary file is empty")
    blank = next((n for n, line in enumerate(lines, 1) if not line.strip()), None)
    if blank is not None:
        raise CheckpointError(path, f"line {blank} holds no symbol (one symbol a line: its id is its line's)")
    return [line.split()[0] for line in lines]


def event_file_lines(text: str, path) -> list[str]:
    """An events vocabulary file's symbols: each line whole (spaces kept), surrounding whitespace stripped, blank
    lines at the end ignored; a blank line before an event is refused (it would shift every later id)."""
    lines = [line.strip() for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    if not lines:
        raise CheckpointError(path, "vocabulary file is empty")
    blank = next((n for n, line in enumerate(lines, 1) if not line), None)
    if blank is not None:
        raise CheckpointError(path, f"line {blank} holds no event (one event a line: its id is its line's)")
    return lines
