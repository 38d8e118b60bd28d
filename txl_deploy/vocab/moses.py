"""The Moses pipelines of the word corpora: text to words and words back to text (sacremoses, English rules).

`wikitext` is HuggingFace TransfoXLTokenizer's pipeline for transfo-xl-wt103: each line stripped, lower-cased when
the vocabulary says so, Moses punctuation normalisation, the Moses tokenizer with aggressive dash splits (`@-@`), no
XML escaping, the vocabulary's `never_split` symbols kept whole; then a comma or dot between two digits becomes its
own `@,@` / `@.@` word. A `delimiter` of `""` reads each line as its characters instead, as TransfoXLTokenizer does.
`lm1b` is the One Billion Word benchmark's preparation (its scripts ran Moses' normalize-punctuation.perl and
tokenizer.perl for English: no aggressive dash split, no escaping).

Back to text, a line's words go through the Moses detokenizer (as TransfoXLTokenizer's `convert_tokens_to_string`),
then `@,@` / `@.@` between spaces join their numbers again; each line on its own.
"""

from __future__ import annotations

import re

from txl_deploy.errors import InputError, install_hint
from txl_deploy.vocab.kinds import LM1B_BOUNDARY

# a comma or dot with a digit on both sides (the `23,000` and `1.80` of WikiText-103's number splitting)
_NUMBER_SEPARATOR = re.compile(r"(?<=\d)[,.](?=\d)")
# the split numbers joined again: " @,@ " -> ",", " @.@ " -> "." (left to right, not overlapping)
_NUMBER_JOINS = ((" @,@ ", ","), (" @.@ ", "."))


class MosesText:
    """The sacremoses objects a vocabulary's text goes through (slow to build: one set per vocabulary)."""

    def __init__(self, tokenizer: str):
        try:
            # late: sacremoses is the `text` extra; whitespace, character and byte vocabularies do without it
            import sacremoses
        except ImportError:
            raise InputError(f"reading and writing text with the {tokenizer} tokenizer needs sacremoses: {install_hint('text')}") from None
        self.normalizer = sacremoses.MosesPunctNormalizer(lang="en")
        self.tokenizer = sacremoses.MosesTokenizer(lang="en")
        self.detokenizer = sacremoses.MosesDetokenizer(lang="en")


def moses(vocab) -> MosesText:
    if vocab._moses is None:
        vocab._moses = MosesText(vocab.tokenizer)
    return vocab._moses


def protected(vocab) -> list[str] | None:
    """The patterns the Moses tokenizer keeps whole: the vocabulary's `never_split` (regular expressions, as
    TransfoXLTokenizer passes them), else its `<unk>` and line-end symbols, so a prompt may write them."""
    if vocab.never_split:
        return list(vocab.never_split)
    held = [re.escape(s) for s in (vocab.unk, vocab.eos) if s is not None]
    return held or None


def split_numbers(words: list[str]) -> list[str]:
    out = []
    for word in words:
        out.extend(_NUMBER_SEPARATOR.sub(lambda m: f" @{m.group()}@ ", word).split())
    return out


def tokenize_line(vocab, line: str) -> list[str]:
    """One line of text (no newline) as the vocabulary's tokenizer splits it into words."""
    line = line.strip()
    if vocab.lower_case:
        line = line.lower()
    if vocab.delimiter == "":
        return list(line)
    if not line:
        return []
    m = moses(vocab)
    text = m.normalizer.normalize(line)
    if vocab.tokenizer == "lm1b":
        return m.tokenizer.tokenize(text, aggressive_dash_splits=False, return_str=False, escape=False,
                                    protected_patterns=protected(vocab))
    words = m.tokenizer.tokenize(text, aggressive_dash_splits=True, return_str=False, escape=False,
                                 protected_patterns=protected(vocab))
    return split_numbers(words)


def detokenize_line(vocab, words: list[str]) -> str:
    """One line's words as text: the Moses detokenizer, then (wikitext) the split numbers joined again."""
    if not words:
        return ""
    text = moses(vocab).detokenizer.detokenize(words)
    if vocab.tokenizer == "wikitext":
        for split, joined in _NUMBER_JOINS:
            text = text.replace(split, joined)
    return text.strip()


def quote_symbols(vocab) -> list[str]:
    """The vocabulary's symbols that the Moses detokenizer counts as quotes (its own test for one)."""
    if vocab._quotes is None:
        quote = moses(vocab).detokenizer.IS_OPEN_QUOTE
        vocab._quotes = [s for s in vocab.symbols if quote.search(s)]
    return vocab._quotes


def is_line_end(vocab, symbol: str) -> bool:
    return symbol == vocab.eos or (vocab.tokenizer == "lm1b" and symbol == LM1B_BOUNDARY)


def decode_words(vocab, symbols: list[str]) -> str:
    """Text of a sequence of word symbols: each line detokenized on its own, a line end (`<eos>`; lm1b: the `<S>`
    that closes a line) a newline. lm1b's `<S>` that opens a line (after a line end or at the start) is dropped."""
    out, line = [], []
    for symbol in symbols:
        if is_line_end(vocab, symbol):
            if line or vocab.tokenizer != "lm1b":
                out.append(detokenize_line(vocab, line) + "\n")
            line = []
        else:
            line.append(symbol)
    out.append(detokenize_line(vocab, line))
    return "".join(out)
