"""One request's generation as text: the sampler, the text of each token, stop strings, and when to finish.

Both engines (the local scheduler and the Triton fleet) drive a `Completion` with log-probs and get back, per token,
what to send: the text that may be shown now, the token's log-prob and alternatives. Stop strings are matched on
the decoded text; text that could still become a stop string is held back until it cannot, and the match itself is
never sent (OpenAI's behaviour). Stop strings are looked for once min_tokens tokens have been generated.

A token's log-probs go out as JSON, which has no infinities: any log-prob below `LOGPROB_FLOOR` or not finite (a
model's -inf for a token it rules out, fp16 underflow) is sent as `LOGPROB_FLOOR`, -9999.0, the value vLLM clamps to.
Each token carries when it was made (`TokenOut.produced`, time.monotonic() in the engine's thread), for the latency
metrics.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from txl_deploy.music.grammar import constraint
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, top_logprobs
from txl_deploy.vocab import CONTINUING, Vocab

LOGPROB_FLOOR = -9999.0
PROMPT_TAIL_TOKENS = 32  # how much of the prompt is decoded for the completion's decoder to continue


def wire_logprob(value) -> float:
    """A log-prob as it is sent: itself, or LOGPROB_FLOOR when it is below that or not finite."""
    value = float(value)
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def token_text(vocab: Vocab, token: int) -> str:
    """One token's own text, as logprobs list it (a byte of a longer character shows as U+FFFD there). The text
    a completion streams comes from the vocabulary's incremental decoder instead (`Completion`)."""
    return vocab.piece(token)


def prompt_decoder(vocab: Vocab, context):
    """The incremental decoder of a completion that continues the prompt `context` (token ids): it is told the
    decoded text of the prompt's last PROMPT_TAIL_TOKENS tokens and those ids, so a word gets its leading space or
    not as the whole text would have it (a Moses detokenizer continues the prompt's line: "1" then "@,@" "000" is
    "1,000"). Only the tail: the decoder looks back on the current line, and a long prompt's line detokenized again
    for every token would cost the engine's thread. With no prompt (a session continued), CONTINUING."""
    tail = np.asarray(context, dtype=np.int64).reshape(-1)[-PROMPT_TAIL_TOKENS:]
    if not tail.size:
        return vocab.stream_decoder(CONTINUING)
    return vocab.stream_decoder(vocab.decode(tail) or CONTINUING, context=tail)


class StopText:
    """Stop strings over a stream of text pieces: `push` returns the text that is safe to show and whether a stop
    string was found (the text before it is returned, the rest dropped); `flush` returns what was held back."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(stops)
        self.held = ""

    def push(self, piece: str, check: bool = True) -> tuple[str, bool]:
        text = self.held + piece
        if check and self.stops:
            start = len(self.held)  # a new match ends inside the new piece
            hits = [i for s in self.stops if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
            if hits:
                self.held = ""
                return text[:min(hits)], True
        keep = self._prefix_kept(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def _prefix_kept(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop string (it may become one)."""
        longest = max((len(s) for s in self.stops), default=1) - 1
        for k in range(min(longest, len(text)), 0, -1):
            end = text[-k:]
            if any(s.startswith(end) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


@dataclass
class TokenOut:
    token: int
    text: str  # text released with this token (may be empty while held back, or longer than its own piece)
    piece: str  # this token's own text
    logprob: float  # as sent (wire_logprob)
    top: dict | None  # {text: log-prob as sent} of the most likely tokens, with logprobs requested
    # where the text this token released starts in the completion (before stop strings cut it): the offsets run
    # through the completion's text, and text[offset[i]:offset[i + 1]] is what token i released
    offset: int
    produced: float  # time.monotonic() when the engine made it


class Completion:
    """Sampling, text and stopping for one request. `next(log_probs)` -> TokenOut; `finish` is then set once the
    request is done ("stop": a stop string or stop token id, "length": max_tokens). On an adaptive softmax's head
    and tails (lazy decoding): `sampler.start(head)` gives a Choice, driven to its token by
    `runtimes.lazy_decode.decide` with the other rows', then `decided(choice)` -> TokenOut."""

    def __init__(self, params: SamplingParams, vocab: Vocab, n_token: int, context=(), clusters=None, grammar=None):
        self.params, self.vocab = params, vocab
        # clusters: the model's adaptive softmax (Clusters.of(config)), so its decisions are the cluster-factored
        # ones TxlRuntime.generate makes: the same tokens as generate, with the same seed. grammar: a compiled music
        # grammar, started after this request's prompt, or a session's GrammarState, which goes on over it
        self.sampler = Sampler(params, n_token, context, vocab=vocab, clusters=clusters,
                               constraint=None if grammar is None else constraint(grammar, vocab, context))
        self.stops = StopText(params.stop)
        # The completion continues the prompt's text (or, with none, a session's earlier text it was not shown): a
        # word gets its leading space unless the prompt ends a line, and a character that a byte-level model spells
        # over several tokens is released once whole.
        self.decoder = prompt_decoder(vocab, context)
        self.finish = None if params.max_tokens > 0 else "length"
        self.offset = 0
        self.tokens: list[int] = []

    @property
    def generated(self) -> int:
        return len(self.tokens)

    def next(self, log_probs: np.ndarray) -> TokenOut:
        """The next token chosen on the whole distribution [V]."""
        tok = self.sampler.choose(log_probs)
        top = None if self.params.logprobs is None else top_logprobs(log_probs, self.params.logprobs)
        return self._out(tok, log_probs[tok], top)

    def decided(self, choice) -> TokenOut:
        """The next token, as the sampler's Choice (`sampler.start(head)`, its tails revealed) decided it: its
        log-prob and alternatives are the model's, from the parts the decision computed."""
        top = None if self.params.logprobs is None else choice.top_logprobs
        return self._out(int(choice.token), choice.logprob, top)

    def _out(self, tok: int, logprob: float, top: list | None) -> TokenOut:
        p = self.params
        self.tokens.append(tok)
        piece = token_text(self.vocab, tok)
        decoded = ""  # the text this token releases from the decoder
        if self.sampler.stopped_by_token(tok):
            text, self.finish = self._rest(), "stop"  # the stop token's own text is not sent
        else:
            decoded = self.decoder.feed(tok)
            text, hit = self.stops.push(decoded, check=self.generated >= p.min_tokens)
            if hit:
                self.finish = "stop"
            elif self.generated >= p.max_tokens:
                text, self.finish = text + self._rest(), "length"
        if top is not None:
            top = {token_text(self.vocab, t): wire_logprob(lp) for t, lp in top}
        out = TokenOut(tok, text, piece, wire_logprob(logprob), top, self.offset, time.monotonic())
        self.offset += len(decoded)
        return out

    def _rest(self) -> str:
        """At the end: what the decoder still holds (an incomplete last character) and what the stop check held."""
        rest, hit = self.stops.push(self.decoder.flush())
        return rest if hit else rest + self.stops.flush()
