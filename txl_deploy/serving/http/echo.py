"""`echo`: the prompt returned before its completion, with each prompt token's log-prob and most likely
alternatives when `logprobs` is asked, as OpenAI's completions API gives them.

Prompt token i is scored on the distribution after tokens 0..i-1: the one at position i - 1 of the call that fed
them. The first token has no such distribution (null), unless a session's memory precedes it: then it is scored on
the session's next-token distribution. The engines feed the prompt asking for every position's distribution and
hand each chunk to `PromptEcho.chunk`; `outs()` then gives the tokens as the completion's are sent. The numbers are
what `TxlRuntime.score` gives on the same ids.
"""

from __future__ import annotations

import time

import numpy as np

from txl_deploy.runtimes.scoring import SCORE_CHUNK_FLOATS
from txl_deploy.runtimes.sampling import top_logprobs
from txl_deploy.serving.http.completion import TokenOut, token_text, wire_logprob
from txl_deploy.vocab import CONTINUING, Vocab


def scoring_chunk(n_token: int, limit: int) -> int:
    """How many prompt tokens one row feeds per call while its log-probs are kept: a [tokens, V] block bounded
    as `TxlRuntime.score` bounds it, and at most `limit` (the engine's prefill chunk)."""
    return max(1, min(int(limit), SCORE_CHUNK_FLOATS // int(n_token)))


def scoring_rows(n_token: int, chunk: int) -> int:
    """How many rows one call scores chunks of `chunk` tokens for, within the same bound (at least one)."""
    return max(1, SCORE_CHUNK_FLOATS // (int(n_token) * int(chunk)))


class PromptEcho:
    """One request's echoed prompt. `k` is the request's `logprobs` (None: the text only, nothing scored);
    `before` the distribution the first token is scored on (a session's next-token log-probs), or None.
    `continuing`: the prompt continues text the session's memory holds (its words get their leading space)."""

    def __init__(self, prompt: np.ndarray, vocab: Vocab, k: int | None, before=None, continuing: bool = False):
        self.prompt, self.vocab, self.k = prompt, vocab, k
        self.before = None if before is None else np.asarray(before)
        self.continuing = continuing
        self.scores: list[tuple[float, dict] | None] = []  # (logprob, top) of each prompt token scored so far

    @classmethod
    def of(cls, job, vocab: Vocab, before=None) -> PromptEcho | None:
        """The echo of an admitted job (an engine.Job) whose session, if any, has `before` as its next-token
        log-probs; None without echo or without a prompt (a session continued: nothing to echo)."""
        if not job.echo or not job.prompt.size:
            return None
        continuing = job.session is not None and job.session.tokens > 0
        return cls(job.prompt, vocab, job.params.logprobs, before=before if continuing else None,
                   continuing=continuing)

    @property
    def scoring(self) -> bool:
        return self.k is not None

    def chunk(self, log_probs: np.ndarray):
        """The distributions [q, V] at every position of the next q prompt tokens fed."""
        start = len(self.scores)
        for j in range(log_probs.shape[0]):
            dist = self.before if j == 0 else log_probs[j - 1]
            self.scores.append(None if dist is None else self._score(dist, int(self.prompt[start + j])))
        self.before = np.array(log_probs[-1])  # a copy: a view would keep the whole call's block alive

    def _score(self, dist: np.ndarray, token: int) -> tuple[float, dict]:
        top = {token_text(self.vocab, t): wire_logprob(lp) for t, lp in top_logprobs(dist, self.k)}
        return wire_logprob(dist[token]), top

    def outs(self) -> list[TokenOut]:
        """The prompt's tokens as sent: the text each releases (decoded as the whole text would be), its own
        piece, its log-prob and alternatives (None where not scored), and where its text starts."""
        decoder = self.vocab.stream_decoder(CONTINUING if self.continuing else "")
        outs, offset, now = [], 0, time.monotonic()
        for i, tok in enumerate(self.prompt.tolist()):
            text = decoder.feed(tok)
            score = self.scores[i] if i < len(self.scores) else None
            logprob, top = (None, None) if score is None else score
            outs.append(TokenOut(tok, text, token_text(self.vocab, tok), logprob, top, offset, now))
            offset += len(text)
        if outs:
            outs[-1].text += decoder.flush()
        return outs
