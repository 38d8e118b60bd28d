"""`n` and `best_of` on /v1/completions: one request, several completions of one prompt.

The engine reads the prompt once and copies its memory and next distribution into a row per completion (a
Triton fleet: a conversation per completion, resumed from the prompt's saved state); choice i samples on its own
seed stream, `seed + i`, so it is what a lone request with that seed gives. This module turns the choices' events
into OpenAI's answer: every choice, or with `best_of` the n whose tokens' log-probs sum highest (OpenAI's "best",
the ranking vLLM uses), in that order. Streamed (only without best_of above n, as OpenAI has it), each chunk
carries its choice's `index`. Usage counts the prompt once and every token generated, those of the completions
best_of leaves out too (they were computed).
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from txl_deploy.serving.http import protocol
from txl_deploy.serving.http.engine import Job
from txl_deploy.serving.http.protocol import ApiError, CompletionRequest


async def answer(engine, ids, params, grammar, body: CompletionRequest, request: Request, model: str, metrics,
                 arrived: float, mailbox, drain_timeout: float):
    """Queue the request's choices as one job and answer it (JSON, or server-sent events); 400 when it needs more
    rows than the server runs at once."""
    param = "best_of" if body.best_of is not None and body.best_of > (body.n or 1) else "n"
    if body.rows > engine.max_batch:
        raise ApiError(400, f"{param} {body.rows}: each completion is a row, and this server runs at most "
                            f"{engine.max_batch} at once (--max-batch)", param=param)
    run = _Choices(engine, body, model, metrics, arrived, mailbox)
    run.job = Job(ids, params, run.emit(0), grammar=grammar, choices=body.rows, choice_emit=run.emit)
    engine.submit(run.job)
    metrics.prompt_tokens.inc(int(ids.size))
    if body.stream:
        return EventSourceResponse(run.sse(), shutdown_grace_period=drain_timeout, ping=15)
    return await run.collect(request)


class _Choice:
    """What one choice has sent: its text, logprobs entries, token ids, log-prob sum, and how it ended."""

    def __init__(self):
        self.text, self.tokens, self.ids = [], [], []
        self.logprob = 0.0
        self.finish: str | None = None
        self.last_token_at = None


class _Choices:
    """One request's choices: the engine's events (tagged with the choice) as one JSON response or SSE chunks."""

    def __init__(self, engine, body: CompletionRequest, model: str, metrics, arrived: float, mailbox):
        self.engine, self.body, self.model, self.metrics, self.arrived = engine, body, model, metrics, arrived
        self.mailbox, self.queue = mailbox, asyncio.Queue()
        self.choices = [_Choice() for _ in range(body.rows)]
        self.tallies = [metrics.tally() for _ in range(body.rows)]
        self.job: Job | None = None
        self.id = protocol.new_id("cmpl")
        self.created = int(time.time())
        self.first_token = True
        self.done = False
        self.prompt_tokens = self.completion_tokens = 0
        self.with_logprobs = body.logprobs is not None
        self.with_ids = bool(body.return_token_ids)

    def emit(self, i: int):
        """The engine's emit for choice i (called from the engine's thread)."""
        def emit(kind, payload):
            if kind == "token":
                self.tallies[i].token()
            self.mailbox.post(self.queue, (i, kind, payload))
        return emit

    def _token(self, i: int, out) -> dict:
        """Record choice i's token; its logprobs entry."""
        choice = self.choices[i]
        if self.first_token:
            self.metrics.ttft.observe(out.produced - self.arrived)
            self.first_token = False
        elif choice.last_token_at is not None:
            self.metrics.itl.observe(out.produced - choice.last_token_at)
        choice.last_token_at = out.produced
        choice.text.append(out.text)
        choice.ids.append(out.token)
        choice.logprob += out.logprob
        entry = {"piece": out.piece, "logprob": out.logprob, "top": out.top, "offset": out.offset}
        choice.tokens.append(entry)
        return entry

    def _finished(self, i: int, payload) -> bool:
        """Choice i is done; True once every choice is."""
        self.choices[i].finish = payload["finish_reason"]
        self.tallies[i].end(payload["finish_reason"])
        self.prompt_tokens = payload["prompt_tokens"]
        self.completion_tokens += payload["completion_tokens"]
        self.done = all(c.finish is not None for c in self.choices)
        return self.done

    def _failed(self, error):
        self.done = True
        reason = "cancelled" if getattr(error, "status", None) == 499 else "error"
        for tally in self.tallies:
            tally.end(reason)

    def _end(self):
        if not self.done and self.job is not None:  # the client went away (or the server is stopping)
            self.engine.cancel(self.job)
        for tally in self.tallies:
            tally.end("cancelled")  # unless it ended otherwise

    def _usage(self) -> dict:
        return protocol.usage(self.prompt_tokens, self.completion_tokens)

    def response(self) -> dict:
        """OpenAI's completion: the n best choices by their summed log-probs (every choice without best_of)."""
        n = self.body.n or 1
        order = range(len(self.choices))
        if len(self.choices) > n:
            order = sorted(order, key=lambda i: -self.choices[i].logprob)[:n]  # stable: ties keep choice order
        picked = [self.choices[i] for i in order]
        return protocol.with_choices([
            protocol.completion(self.id, self.model, "".join(c.text), c.finish, self._usage(),
                                c.tokens if self.with_logprobs else None, c.ids if self.with_ids else None, None,
                                index=index) for index, c in enumerate(picked)])

    async def collect(self, request: Request):
        watcher = asyncio.create_task(self._watch_disconnect(request))
        try:
            while True:
                i, kind, payload = await self.queue.get()
                if kind == "token":
                    self._token(i, payload)
                elif kind == "done":
                    if self._finished(i, payload):
                        return JSONResponse(self.response())
                else:
                    self._failed(payload)
                    raise payload
        finally:
            watcher.cancel()
            self._end()

    async def _watch_disconnect(self, request: Request):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.engine.cancel(self.job)
                self.mailbox.post(self.queue, (0, "error", ApiError(499, "the client closed the connection")))
                return

    def _chunk(self, i: int, outs: list, entries: list, finish: str | None = None) -> dict:
        return protocol.chunk(self.id, self.model, self.created, "".join(o.text for o in outs), finish,
                              entries if self.with_logprobs and outs else None,
                              [o.token for o in outs] if self.with_ids and outs else None, index=i)

    async def sse(self):
        """Server-sent events: each choice's tokens as chunks with its index (the tokens waiting together in one
        chunk per choice), each choice's finish, then the usage if asked, and [DONE]."""
        try:
            while True:
                events = [await self.queue.get()]
                while not self.queue.empty():
                    events.append(self.queue.get_nowait())
                waiting: dict[int, tuple[list, list]] = {}
                for i, kind, payload in events:
                    if kind == "token":
                        outs, entries = waiting.setdefault(i, ([], []))
                        outs.append(payload)
                        entries.append(self._token(i, payload))
                        continue
                    if i in waiting:
                        yield {"data": json.dumps(self._chunk(i, *waiting.pop(i)))}
                    if kind == "error":
                        self._failed(payload)
                        yield {"data": json.dumps(payload.body())}
                        yield {"data": "[DONE]"}
                        return
                    every = self._finished(i, payload)
                    yield {"data": json.dumps(self._chunk(i, [], [], payload["finish_reason"]))}
                    if every:
                        if self.body.stream_options is not None and self.body.stream_options.include_usage:
                            yield {"data": json.dumps(protocol.usage_chunk(self.id, self.model, self.created,
                                                                           self._usage()))}
                        yield {"data": "[DONE]"}
                        return
                for i, (outs, entries) in waiting.items():
                    if self.with_logprobs or self.with_ids or any(o.text for o in outs):
                        yield {"data": json.dumps(self._chunk(i, outs, entries))}
        finally:
            self._end()
