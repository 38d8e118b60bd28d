"""The kinds of vocabulary, the symbols each may hold, and how a vocabulary's kind is chosen.

- `word`: whitespace-separated words, `<eos>` at every line end, unknown words map to `<unk>` (WikiText-103, lm1b).
- `char`: one symbol per character; newlines are ordinary symbols (our demo model).
- `bytes`: the paper's enwik8. The original preprocessing (`prep_enwik8.py`) writes each byte of the raw file as its
  decimal value ("84" is the byte `T`) and turns the newline byte into a line break, which `data_utils.py` then
  drops (`add_eos=False` for enwik8 and text8): the model never sees or predicts a newline. Text is UTF-8.
- `text8`: the paper's text8. `prep_text8.py` writes each character of the corpus (lowercase a-z and spaces) with
  `_` standing for the space.
- `events`: symbolic music's event symbols (REMI's `Note On_60`, remi-xl's `Note_Pitch_60`, ProgGP's
  `wait:480`), kept verbatim, spaces included: text is one event a line. Its vocabulary may name the
  representation its events are written in (`remi`, `remi-xl`; txl_deploy.music.representation).

A `bytes` or `text8` vocabulary may also hold `<unk>` (what a byte or character it lacks becomes) and `<eos>` (a
newline); the paper's hold neither.
"""

from __future__ import annotations

import re

KINDS = ("word", "char", "bytes", "text8", "events")
UNK, EOS = "<unk>", "<eos>"
# How a word vocabulary reads and writes text: split on whitespace; WikiText-103's Moses pipeline (HuggingFace's
# TransfoXLTokenizer for transfo-xl-wt103: numbers split as `@,@` / `@.@`, dashes as `@-@`); the One Billion Word
# benchmark's Moses tokenization, each line between `<S>` symbols, unknown words `<UNK>`.
TOKENIZERS = ("whitespace", "wikitext", "lm1b")
LM1B_BOUNDARY, LM1B_UNK = "<S>", "<UNK>"
WIKITEXT_MARKERS = ("@-@", "@,@", "@.@")
SPECIALS = (UNK, EOS)
TEXT8_SPACE = "_"
TEXT8_LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEXT8_SYMBOLS = frozenset(TEXT8_LETTERS + TEXT8_SPACE)
# The corpus names of the original data scripts (`--dataset`, corpus-info.json's "dataset") that fix the kind.
DATASET_KINDS = {"enwik8": "bytes", "text8": "text8"}
DESCRIPTIONS = {
    "word": "words split on whitespace, <eos> at line ends",
    "char": "one symbol per character",
    "bytes": "UTF-8 bytes as decimal symbols (enwik8); newlines dropped",
    "text8": "lowercase a-z and spaces, '_' for the space (text8)",
    "events": "music events kept verbatim, one event a line",
}
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,2}\Z")


class UnknownKindError(ValueError):
    """A vocabulary of a kind this version does not know: written by a newer txl-deploy, never guessed at."""

    def __init__(self, kind):
        super().__init__(f"vocabulary kind {kind!r} is not one this txl-deploy knows ({', '.join(KINDS)}); it was "
                         "probably written by a newer txl-deploy: upgrade txl-deploy to read it")
        self.kind = kind


def byte_value(symbol) -> int | None:
    """The byte a `bytes` symbol stands for (its decimal value, written as `str(byte)` writes it), else None."""
    if isinstance(symbol, str) and _DECIMAL.fullmatch(symbol) and int(symbol) <= 255:
        return int(symbol)
    return None


def misfit(kind: str, symbols) -> str | None:
    """Why `symbols` cannot be a vocabulary of `kind` (the first symbol that does not fit), or None."""
    if kind == "bytes":
        for s in symbols:
            if s not in SPECIALS and byte_value(s) is None:
                return f"symbol {s!r} is not a byte value (a decimal number from 0 to 255), <unk> or <eos>"
    elif kind == "text8":
        for s in symbols:
            if s not in SPECIALS and s not in TEXT8_SYMBOLS:
                return f"symbol {s!r} is not a lowercase letter a-z, '_' (the space), <unk> or <eos>"
    elif kind == "events":
        for s in symbols:
            if not isinstance(s, str) or not s or s != s.strip() or "\n" in s or "\r" in s:
                return f"event {s!r} cannot be written one a line (it is empty, holds a line break, or begins or " \
                       "ends in whitespace)"
    return None


def detect_kind(symbols) -> str | None:
    """`bytes` when every symbol is a decimal byte value, `text8` when the symbols are exactly a-z and `_` (either
    beside <unk> / <eos>), else None."""
    plain = [s for s in symbols if s not in SPECIALS]
    if not plain:
        return None
    if all(byte_value(s) is not None for s in plain):
        return "bytes"
    if set(plain) == TEXT8_SYMBOLS and len(plain) == len(TEXT8_SYMBOLS):
        return "text8"
    return None


def detect_tokenizer(symbols) -> str:
    """The tokenizer a word vocabulary's symbols show: `wikitext` when they hold WikiText-103's split markers
    (`@-@`, `@,@`, `@.@`), `lm1b` when they hold `<S>` and no `<eos>` (the One Billion Word vocabulary), else
    `whitespace`."""
    held = set(symbols)
    if held.intersection(WIKITEXT_MARKERS):
        return "wikitext"
    if LM1B_BOUNDARY in held and EOS not in held:
        return "lm1b"
    return "whitespace"


def choose_kind(symbols, explicit: str | None = None, dataset: str | None = None, default: str = "word") -> str:
    """The kind of a vocabulary read from another pipeline's files: `explicit` (what the user asked for), else the
    kind its corpus (`dataset`) fixes, else the one its symbols show, else `default`. ValueError when the asked or
    the corpus's kind does not fit the symbols."""
    if explicit is not None:
        if explicit not in KINDS:
            raise UnknownKindError(explicit)
        problem = misfit(explicit, symbols)
        if problem:
            raise ValueError(f"cannot be a {explicit} vocabulary: {problem}")
        return explicit
    if dataset in DATASET_KINDS:
        kind = DATASET_KINDS[dataset]
        problem = misfit(kind, symbols)
        if problem:
            raise ValueError(f"its corpus is {dataset}, whose vocabulary is of kind {kind}, but {problem}")
        return kind
    return detect_kind(symbols) or default


def kind_note(vocab) -> str | None:
    """A word for a vocabulary stored as word or char whose symbols are those of enwik8 or text8 (converted before
    txl-deploy knew those kinds): text would be read as whitespace-separated symbols."""
    if vocab is None or vocab.kind not in ("word", "char"):
        return None
    seen = detect_kind(vocab.symbols)
    if seen is None:
        return None
    return (f"the vocabulary is stored as kind {vocab.kind}, but its symbols are those of a {seen} vocabulary "
            f"({DESCRIPTIONS[seen]}): pass --vocab-kind {seen} to convert or export to read text as the model "
            "was trained")
