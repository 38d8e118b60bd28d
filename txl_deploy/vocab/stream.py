"""Generated tokens to text as they arrive: what can be printed after each token, never half a character.

A byte vocabulary spells a character over up to four tokens: `feed` returns "" until the character is complete,
then the whole character; bytes that cannot be UTF-8 are replaced by U+FFFD (the "maximal subpart" practice of
Unicode, as Python's `errors="replace"` and the browsers' TextDecoder both do), never raised. `flush` ends the
stream: an incomplete character left over becomes U+FFFD. Word vocabularies put a space before a word unless the
text so far is empty or ends in whitespace, and `<eos>` is a line break, so the pieces of a stream started empty
join to exactly `Vocab.decode` of the same ids.
"""

from __future__ import annotations

import codecs
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
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if vocab.kind == "bytes" else None

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
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        if text:
            self._last = text[-1]
        return text

    def _text(self, i: int, symbol: str) -> str:
        kind = self.vocab.kind
        if kind == "bytes":
            value = self.vocab.byte_of[i]
            if value is not None:
                return self._utf8.decode(bytes((value,)))
            if symbol == EOS:
                return self._utf8.decode(b"\n")
            return self.flush() + REPLACEMENT  # <unk>: an unknown byte ends any character in progress
        if kind == "text8":
            return " " if symbol == TEXT8_SPACE else "\n" if symbol == EOS else REPLACEMENT if symbol == UNK else symbol
        if kind == "char":
            return symbol
        if symbol == self.vocab.eos:
            return "\n"
        return symbol if not self._last or self._last.isspace() else " " + symbol
