"""Generated tokens to text as they arrive: what can be printed after each token, never half a character.

A byte vocabulary spells a character over up to four tokens: `feed` returns "" until the character is complete,
then the whole character; bytes that cannot be UTF-8 are replaced by U+FFFD, never raised. `flush` ends the
stream: an incomplete character left over becomes U+FFFD. The bytes are decoded by the UTF-8 decoder of the WHATWG
Encoding Standard (what browsers' TextDecoder runs, so the page's txl.js prints the same pieces at the same tokens),
which replaces as Unicode's "maximal subpart" practice says: the whole text equals Python's
`bytes.decode("utf-8", "replace")`. Word vocabularies put a space before a word unless the
text so far is empty or ends in whitespace, and `<eos>` is a line break, so the pieces of a stream started empty
join to exactly `Vocab.decode` of the same ids.
"""

from __future__ import annotations

import operator

from txl_deploy.errors import InputError
from txl_deploy.vocab.kinds import EOS, TEXT8_SPACE, UNK

REPLACEMENT = "\ufffd"
# `after` of a stream that continues text it was not shown (a word then gets its leading space)
CONTINUING = object()


class StreamDecoder:
    """Incremental decoding of one stream of token ids (`Vocab.stream_decoder()`).

    >>> decoder = vocab.stream_decoder(after=prompt)
    >>> for token_id in tokens:
    ...     print(decoder.feed(token_id), end="", flush=True)
    >>> print(decoder.flush())
    """

    def __init__(self, vocab, after=""):
        self.vocab = vocab
        self._last = "x" if after is CONTINUING else str(after)[-1:]  # the last character of the text so far
        self._utf8 = Utf8Decoder() if vocab.kind == "bytes" else None

    def feed(self, token_id) -> str:
        """The text that token `token_id` completes (may be "": a character's first bytes)."""
        try:
            i = operator.index(token_id)
        except TypeError:
            raise InputError(f"token ids must be integers, got {token_id!r}") from None
        if not 0 <= i < len(self.vocab.symbols):
            raise InputError(f"token id {token_id} is outside the vocabulary [0, {len(self.vocab.symbols)})")
        text = self._text(i, self.vocab.symbols[i])
        if text:
            self._last = text[-1]
        return text

    def flush(self) -> str:
        """The end of the stream: U+FFFD for an incomplete character left over, else ""."""
        if self._utf8 is None:
            return ""
        text = self._utf8.flush()
        if text:
            self._last = text[-1]
        return text

    def pieces(self, token_ids):
        """The text of a stream of token ids, piece by piece as they arrive (no empty pieces), then flushed."""
        for token_id in token_ids:
            text = self.feed(token_id)
            if text:
                yield text
        tail = self.flush()
        if tail:
            yield tail

    def _text(self, i: int, symbol: str) -> str:
        kind = self.vocab.kind
        if kind == "bytes":
            value = self.vocab.byte_of[i]
            if value is not None:
                return self._utf8.feed(value)
            if symbol == EOS:
                return self._utf8.feed(0x0A)
            return self.flush() + REPLACEMENT  # <unk>: an unknown byte ends any character in progress
        if kind == "text8":
            return " " if symbol == TEXT8_SPACE else "\n" if symbol == EOS else REPLACEMENT if symbol == UNK else symbol
        if kind == "char":
            return symbol
        if symbol == self.vocab.eos:
            return "\n"
        return symbol if not self._last or self._last.isspace() else " " + symbol


class Utf8Decoder:
    """The WHATWG Encoding Standard's UTF-8 decoder, one byte at a time, errors replaced by U+FFFD."""

    def __init__(self):
        self._reset()

    def _reset(self):
        self.needed, self.seen, self.code_point, self.lower, self.upper = 0, 0, 0, 0x80, 0xBF

    def feed(self, b: int) -> str:
        if self.needed == 0:
            if b <= 0x7F:
                return chr(b)
            if 0xC2 <= b <= 0xDF:
                self.needed, self.code_point = 1, b & 0x1F
            elif 0xE0 <= b <= 0xEF:
                self.lower, self.upper = (0xA0 if b == 0xE0 else 0x80), (0x9F if b == 0xED else 0xBF)
                self.needed, self.code_point = 2, b & 0x0F
            elif 0xF0 <= b <= 0xF4:
                self.lower, self.upper = (0x90 if b == 0xF0 else 0x80), (0x8F if b == 0xF4 else 0xBF)
                self.needed, self.code_point = 3, b & 0x07
            else:
                return REPLACEMENT
            return ""
        if not self.lower <= b <= self.upper:
            # the sequence so far is a maximal subpart: replace it, then read this byte afresh
            self._reset()
            return REPLACEMENT + self.feed(b)
        self.lower, self.upper = 0x80, 0xBF
        self.code_point = (self.code_point << 6) | (b & 0x3F)
        self.seen += 1
        if self.seen < self.needed:
            return ""
        text = chr(self.code_point)
        self._reset()
        return text

    def flush(self) -> str:
        """The end of the stream: U+FFFD for an incomplete sequence."""
        pending = self.needed != 0
        self._reset()
        return REPLACEMENT if pending else ""
