"""Generated tokens to text as they arrive: what can be printed after each token, never half a character.

A byte vocabulary spells a character over up to four tokens: `feed` returns "" until the character is complete,
then the whole character; bytes that cannot be UTF-8 are replaced by U+FFFD, never raised. `flush` ends the
stream: an incomplete character left over becomes U+FFFD. The bytes are decoded by the UTF-8 decoder of the WHATWG
Encoding Standard (what browsers' TextDecoder runs, so the page's txl.js prints the same pieces at the same tokens),
which replaces as Unicode's "maximal subpart" practice says: the whole text equals Python's
`bytes.decode("utf-8", "replace")`. Word vocabularies put a space before a word unless the
text so far is empty or ends in whitespace, and `<eos>` is a line break, so the pieces of a stream started empty
join to exactly `Vocab.decode` of the same ids.

Word vocabularies read with a Moses tokenizer (`wikitext`, `lm1b`) are detokenized a line at a time (`MosesLine`):
a word is printed once no later word can change the text before it, and a line end prints the rest of the line.
"""

from __future__ import annotations

import operator

from txl_deploy.errors import InputError
from txl_deploy.vocab import moses
from txl_deploy.vocab.kinds import EOS, TEXT8_SPACE, UNK, WIKITEXT_MARKERS

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

    def __init__(self, vocab, after="", context=None):
        self.vocab = vocab
        self._last = "x" if after is CONTINUING else str(after)[-1:]  # the last character of the text so far
        self._utf8 = Utf8Decoder() if vocab.kind == "bytes" else None
        self._moses = None
        if vocab.kind == "word" and vocab.tokenizer != "whitespace":
            self._moses = MosesLine(vocab, self._seed(after, context))

    def _seed(self, after, context) -> list[str]:
        """The words of the line the stream continues: those of `context` after its last line end; without
        `context`, the last word of `after` (as it stands: enough to place a space or not), or a stand-in word
        for `CONTINUING`; none when the text so far is empty or ends in whitespace."""
        if context is not None:
            symbols = [self.vocab.symbols[i] for i in _checked_ids(self.vocab, context)]
            ends = [n for n, s in enumerate(symbols) if moses.is_line_end(self.vocab, s)]
            return symbols[ends[-1] + 1:] if ends else symbols
        if not self._last or self._last.isspace():
            return []
        return ["x"] if after is CONTINUING else [str(after).split()[-1]]

    def feed(self, token_id) -> str:
        """The text that token `token_id` completes (may be "": a character's first bytes)."""
        try:
            i = operator.index(token_id)
        except TypeError:
            raise InputError(f"token ids must be integers, got {token_id!r}") from None
        if not 0 <= i < len(self.vocab.symbols):
            raise InputError(f"token id {token_id} is outside the vocabulary [0, {len(self.vocab.symbols)})")
        if self._moses is not None:
            return self._moses.feed(self.vocab.symbols[i])
        text = self._text(i, self.vocab.symbols[i])
        if text:
            self._last = text[-1]
        return text

    def flush(self) -> str:
        """The end of the stream: U+FFFD for an incomplete character left over, the rest of a Moses line, else
        ""."""
        if self._moses is not None:
            return self._moses.flush()
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
        if kind == "events":  # one event a line; a line the text so far left open is ended first
            return symbol + "\n" if not self._last or self._last == "\n" else "\n" + symbol + "\n"
        if symbol == self.vocab.eos:
            return "\n"
        return symbol if not self._last or self._last.isspace() else " " + symbol


def _checked_ids(vocab, ids) -> list[int]:
    out = []
    for token_id in ids:
        try:
            i = operator.index(token_id)
        except TypeError:
            raise InputError(f"token ids must be integers, got {token_id!r}") from None
        if not 0 <= i < len(vocab.symbols):
            raise InputError(f"token id {token_id} is outside the vocabulary [0, {len(vocab.symbols)})")
        out.append(i)
    return out


class MosesLine:
    """The current line of a Moses-detokenized stream: prints what the words so far have fixed.

    The Moses detokenizer joins `@-@` to the words on both sides and `@,@` / `@.@` to the numbers on both sides, so
    a word is held back while a later word could still change it; everything else about its text is decided by the
    words before it. A printed piece is therefore never changed, and a line's pieces join to exactly
    `moses.detokenize_line` of its words. Only a window of the line's last words is detokenized per word, the
    dropped ones stood for by a short seed. The proof of both, which reads sacremoses' detokenizer (hence the
    bounded version in the `text` extra), is in docs/runtime.md, "Why a printed piece never changes".
    """

    WINDOW = 64  # words; a window of at most 2 * WINDOW words is detokenized per word

    def __init__(self, vocab, seed: list[str]):
        self.vocab = vocab
        self.hyphens = WIKITEXT_MARKERS[0] in vocab.index
        self._start(seed)

    def _start(self, seed):
        self.kept = ""  # the text of the words dropped from the window
        self.seed_len, self.seed_text = 0, ""  # the window's first words stand for the dropped ones
        self.words = list(seed)  # the window
        self.shown = moses.detokenize_line(self.vocab, self.words)  # printed already (by us or as the prompt)

    def _text(self, k: int) -> str:
        """The text of the line up to the window's k-th word (k >= seed_len)."""
        return self.kept + moses.detokenize_line(self.vocab, self.words[:k])[len(self.seed_text):]

    def _settled(self) -> int:
        words, k = self.words, len(self.words)
        if self.hyphens:
            k -= 1  # the next word might be @-@, which would join the last word to the word after it
        while k > 0 and (words[k - 1] in WIKITEXT_MARKERS or (k < len(words) and words[k] == WIKITEXT_MARKERS[0])):
            k -= 1
        return max(k, self.seed_len)

    def _new(self, text: str) -> str:
        if text.startswith(self.shown):
            out, self.shown = text[len(self.shown):], text
            return out
        if self.shown.startswith(text):
            return ""  # fewer words settled than a prompt's line already showed
        # a prompt's own last word changed by the stream (e.g. joined to it by `@-@`): what it printed stays
        out, self.shown = text[len(_common_prefix(text, self.shown)):], text
        return out

    def feed(self, symbol: str) -> str:
        if moses.is_line_end(self.vocab, symbol):
            if not self.words and self.vocab.tokenizer == "lm1b":
                return ""  # the <S> that opens a line
            out = self._new(self._text(len(self.words))) + "\n"
            self._start([])
            return out
        self.words.append(symbol)
        if len(self.words) - self.seed_len > 2 * self.WINDOW:
            self._drop_words()
        return self._new(self._text(self._settled()))

    def flush(self) -> str:
        out = self._new(self._text(len(self.words)))
        self._start([])
        return out

    def _drop_words(self):
        """Drop the window's words before the last boundary b at least WINDOW words back where the seed is exact
        (docs/runtime.md: why a piece never changes); none when no such boundary is found."""
        words, quote = self.words, moses.moses(self.vocab).detokenizer.IS_OPEN_QUOTE
        for b in range(len(words) - self.WINDOW, self.seed_len + 1, -1):
            if not (set(words[b - 2:b + 1]) & set(WIKITEXT_MARKERS)) and not quote.search(words[b - 1]):
                break
        else:
            return
        seed = []
        for q in moses.quote_symbols(self.vocab):
            # a quote after a plain word attaches to it (no space) exactly when its kind's count is odd
            if self._attaches(words[:b], q) != self._attaches(seed, q):
                seed.append(q)
        self.kept = self._text(b)
        self.words = seed + words[b - 1:]
        self.seed_len = len(seed) + 1
        self.seed_text = moses.detokenize_line(self.vocab, self.words[:self.seed_len])

    def _attaches(self, words: list[str], quote: str) -> bool:
        return moses.detokenize_line(self.vocab, words + ["x", quote]).endswith("x" + quote)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


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
