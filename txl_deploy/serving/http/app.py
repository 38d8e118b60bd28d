"""The OpenAI-compatible HTTP API (FastAPI): completions with streaming (sse-starlette), sessions, health, metrics.

The app turns requests into engine jobs and engine events into OpenAI's responses; the engine (`scheduler.Scheduler`
in-process, or `fleet.FleetEngine` over Triton servers) does the work. The engine is built by `load_engine` in a
thread when the app starts, so /health answers 503 until the model is loaded, then 200 (503 again while draining).

Endpoints: POST /v1/completions, GET /v1/models, sessions (POST /v1/sessions, GET/DELETE /v1/sessions/{id},
POST /v1/sessions/{id}/park -> the memory's bytes, POST /v1/sessions/{id}/restore <- those bytes,
POST /v1/sessions/{id}/fork -> a new session with a copy of its memory), GET /health,
GET /metrics. With an api_key every /v1 path needs `Authorization: Bearer <key>`, checked (in constant time)
before any of the body is read. Every error is OpenAI's error object. Request bodies are bounded (413), prompts
and max_tokens too (400), the queue too (429). Prompts are tokenized in a small pool of threads, never on the event
loop; the engine's thread decodes the tokens it makes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from txl_deploy.errors import InputError, TxlError
from txl_deploy.music.grammar import compiled
from txl_deploy.runtimes.sampling import SamplingParams
from txl_deploy.serving.http import beams, choices, protocol
from txl_deploy.serving.http.engine import Job
from txl_deploy.serving.http.guard import Guard, key_error, key_matches
from txl_deploy.serving.http.metrics import CONTENT_TYPE, Metrics, TokenTally
from txl_deploy.serving.http.protocol import ApiError, CompletionRequest, SessionCreate, error_body

logger = logging.getLogger(__name__)

STATE_OVERHEAD_BYTES = 1 << 20  # a parked state's .npz header and keys, beyond its arrays
TEXT_WORKERS = 4  # threads that tokenize prompts: a long prompt waits for a free one instead of blocking the loop
BUSY_RETRY_AFTER_S = 1  # a busy session is free once its request ends: usually within a generation


@dataclass
class ServeSettings:
    model_name: str
    api_key: str | None = None
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096  # the largest max_tokens a request may ask for
    max_body_bytes: int = 1 << 20
    drain_timeout: float = 30.0  # on SIGTERM: how long running streams may take to finish


class _Mailbox:
    """Engine events (from the engine thread) into the requests' asyncio queues, waking the event loop once for
    everything posted meanwhile (one engine step's tokens for every stream), not once per token."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending = []
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, queue: asyncio.Queue, item):
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self):
        with self._lock:
            items, self._pending, self._scheduled = self._pending, [], False
        for queue, item in items:
            queue.put_nowait(item)


class _Events:
    """One request's events, through the loop's mailbox into its queue; its tokens counted as the engine makes
    them."""

    def __init__(self, mailbox: _Mailbox, tally: TokenTally):
        self.mailbox, self.queue, self.tally = mailbox, asyncio.Queue(), tally

    def emit(self, kind, payload):
        if kind == "token":
            self.tally.token()
        self.mailbox.post(self.queue, (kind, payload))


def create_app(load_engine: Callable[[], object], settings: ServeSettings, on_load_error: Callable | None = None):
    """The ASGI app. `load_engine()` builds and returns the engine (in a thread, at startup); `on_load_error(e)` is
    called if it fails (the server then exits)."""
    metrics = Metrics()
    state = {"engine": None, "error": None, "draining": False, "loaded_at": None}
    text_pool = concurrent.futures.ThreadPoolExecutor(TEXT_WORKERS, thread_name_prefix="txl-serve-text")

    def load(loop):
        try:
            engine = load_engine()
            engine.start()
            metrics.watch(engine)
            engine.on_batch = metrics.batch.observe
            state["engine"], state["loaded_at"] = engine, int(time.time())
            logger.info("ready: serving %r", settings.model_name)
        except Exception as e:  # noqa: BLE001 - reported, and the server stops
            state["error"] = e
            if not isinstance(e, TxlError):
                logger.exception("the model could not be loaded")
            if on_load_error is not None:
                loop.call_soon_threadsafe(on_load_error, e)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loader = threading.Thread(target=load, args=(asyncio.get_running_loop(),), name="txl-serve-load",
                                  daemon=True)
        loader.start()
        yield
        state["draining"] = True
        await run_in_threadpool(loader.join)
        if state["engine"] is not None:
            await run_in_threadpool(state["engine"].stop, settings.drain_timeout)
        text_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="txl-deploy", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    mailboxes = {}

    def mailbox(loop) -> _Mailbox:
        box = mailboxes.get(loop)
        if box is None:
            box = mailboxes[loop] = _Mailbox(loop)
        return box
    app.state.txl = state

    def engine():
        if state["engine"] is not None and state["engine"].failure is not None:
            raise ApiError(503, f"the engine stopped on an internal error ({type(state['engine'].failure).__name__}): "
                                "this server takes no more requests", type="server_error", code="engine_failed")
        if state["draining"] or (state["engine"] is not None and state["engine"].draining):
            raise ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                           code="draining")
        if state["engine"] is None:
            raise ApiError(503, "the model is still loading", type="server_error", code="loading",
                           headers={"Retry-After": "1"})
        return state["engine"]

    def authorized(request: Request):
        # Guard has checked already; this holds for the routes when the app is run without it
        if settings.api_key is None:
            return
        if not key_matches(request.headers.get("authorization", "").encode("latin-1"), settings.api_key):
            raise key_error()

    guarded = [Depends(authorized)]

    # -- errors in OpenAI's shape ---------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        headers = exc.headers
        if exc.code == "session_busy":
            headers = {"Retry-After": str(BUSY_RETRY_AFTER_S), **headers}
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(InputError)
    async def input_error(request, exc: InputError):
        message = str(exc)
        first = message.split(" ", 1)[0].split("[", 1)[0]
        param = first if first in CompletionRequest.model_fields else None
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if x not in ("body", "path")]
        param = ".".join(loc) or None
        if err.get("type") == "extra_forbidden":
            message = f"unknown field {param!r}: this server does not support it"
        elif err.get("type") == "json_invalid":
            param = None
            message = f"the body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})"
        else:
            message = f"{param}: {err['msg']}" if param else err["msg"]
        return JSONResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(Exception)
    async def internal(request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type="server_error"), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", type=kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    # -- health, metrics, models --------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state["engine"] is not None and not state["engine"].alive and not state["draining"]:
            return JSONResponse({"status": "failed" if state["engine"].failure is not None else "stopped"},
                                status_code=503)
        if state["engine"] is None or state["draining"] or state["engine"].draining:
            what = "draining" if state["draining"] or state["engine"] is not None else "loading"
            return JSONResponse({"status": what}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=guarded)
    async def models():
        eng = engine()
        return {"object": "list", "data": [{
            "id": settings.model_name, "object": "model", "created": state["loaded_at"], "owned_by": "txl-deploy",
            "n_token": eng.n_token, "mem_len": eng.mem_len, "session_memory_bytes": eng.bytes_per_session}]}

    # -- completions ------------------------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=guarded)
    async def completions(body: CompletionRequest, request: Request):
        arrived = time.monotonic()
        eng = engine()
        bad = body.unsupported()
        if bad is not None:
            raise bad
        if body.model is not None and body.model != settings.model_name:
            raise ApiError(404, f"model {body.model!r} is not served here; this server serves "
                                f"{settings.model_name!r}", param="model", code="model_not_found")
        ids = await asyncio.get_running_loop().run_in_executor(text_pool, _prompt_ids, eng, body.prompt, settings)
        kwargs = body.sampling_kwargs()
        if kwargs.get("max_tokens", 16) > settings.max_tokens:
            raise ApiError(400, f"max_tokens {kwargs['max_tokens']} is more than this server generates per "
                                f"request ({settings.max_tokens}, --max-tokens)", param="max_tokens")
        if body.num_beams is not None:  # beam search
            return await beams.answer(eng, ids, body, settings.model_name, metrics)
        params = SamplingParams(**kwargs)
        grammar = None if body.grammar is None else _grammar(body.grammar, eng.vocab)
        if body.rows > 1:  # n or best_of
            return await choices.answer(eng, ids, params, grammar, body, request, settings.model_name, metrics,
                                        arrived, mailbox(asyncio.get_running_loop()), settings.drain_timeout)
        events = _Events(mailbox(asyncio.get_running_loop()), metrics.tally())
        job = Job(ids, params, events.emit, session_id=body.session_id, grammar=grammar, echo=bool(body.echo))
        eng.submit(job)
        metrics.prompt_tokens.inc(int(ids.size))
        run = _Run(eng, job, events, body, settings.model_name, metrics, arrived)
        if body.stream:
            return EventSourceResponse(run.sse(), shutdown_grace_period=settings.drain_timeout, ping=15)
        return await run.collect(request)

    # -- sessions -----------------------------------------------------------------------------------------------
    @app.post("/v1/sessions", dependencies=guarded, status_code=201)
    async def create_session(request: Request):
        eng = engine()
        spec = await _session_spec(request)
        session = eng.create_session(spec.id)
        return JSONResponse(eng.sessions.info(session, eng.bytes_per_session), status_code=201)

    @app.get("/v1/sessions", dependencies=guarded)
    async def list_sessions():
        eng = engine()
        infos = []
        for id_ in eng.sessions.all_ids():
            with contextlib.suppress(ApiError):  # gone in between
                infos.append(eng.sessions.info(eng.sessions.get(id_), eng.bytes_per_session))
        return {"object": "list", "data": infos}

    @app.get("/v1/sessions/{session_id}", dependencies=guarded)
    async def read_session(session_id: str):
        eng = engine()
        return eng.sessions.info(eng.sessions.get(session_id), eng.bytes_per_session)

    @app.delete("/v1/sessions/{session_id}", dependencies=guarded)
    async def delete_session(session_id: str):
        eng = engine()
        eng.delete_session(session_id)
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/sessions/{session_id}/park", dependencies=guarded)
    async def park(session_id: str):
        eng = engine()
        blob = await run_in_threadpool(eng.park, session_id)
        return Response(blob, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{session_id}.npz"'})

    @app.post("/v1/sessions/{session_id}/fork", dependencies=guarded, status_code=201)
    async def fork(session_id: str, request: Request):
        eng = engine()
        spec = await _session_spec(request)
        session = await run_in_threadpool(eng.fork, session_id, spec.id)
        return JSONResponse(eng.sessions.info(session, eng.bytes_per_session), status_code=201)

    @app.post("/v1/sessions/{session_id}/restore", dependencies=guarded, status_code=201)
    async def restore(session_id: str, request: Request):
        eng = engine()
        _check_id(session_id)
        blob = await request.body()
        if not blob:
            raise ApiError(400, "send the parked state's bytes as the request body", code="invalid_state")
        session = await run_in_threadpool(eng.restore, session_id, blob)
        return JSONResponse(eng.sessions.info(session, eng.bytes_per_session), status_code=201)

    def state_limit():
        eng = state["engine"]
        per = getattr(eng, "bytes_per_session", None) or settings.max_body_bytes
        return per + STATE_OVERHEAD_BYTES

    return Guard(app, settings, metrics, state_limit)


async def _session_spec(request: Request) -> SessionCreate:
    """A session's create or fork body: optional JSON naming the new session's id."""
    raw = await request.body()
    try:
        return SessionCreate.model_validate_json(raw) if raw.strip() else SessionCreate()
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _check_id(session_id: str):
    if not re.fullmatch(protocol.SESSION_ID_PATTERN.strip("^$"), session_id):
        raise ApiError(400, "a session id is 1-128 letters, digits, '.', '_' or '-'", param="session_id")


def _grammar(name: str, vocab):
    """The request's music grammar compiled for the served vocabulary (kept for reuse); 400 naming `grammar`."""
    try:
        return compiled(name, vocab)
    except InputError as e:
        raise ApiError(400, str(e), param="grammar") from None


def _prompt_ids(engine, prompt, settings: ServeSettings) -> np.ndarray:
    """The prompt as token ids: text through the vocabulary, or ids checked against it; one prompt per request."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, f"one prompt per request, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = engine.vocab.encode(prompt)
    else:
        ids = np.asarray(prompt, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= engine.n_token):
            bad = int(ids.min() if ids.min() < 0 else ids.max())
            raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {engine.n_token})",
                           param="prompt")
    if ids.size > settings.max_prompt_tokens:
        raise ApiError(400, f"the prompt has {ids.size} tokens, more than this server accepts "
                            f"({settings.max_prompt_tokens}, --max-prompt-tokens)", param="prompt")
    return ids


class _Run:
    """One completion request's answer: the engine's events as SSE chunks or as one JSON response."""

    def __init__(self, engine, job: Job, events: _Events, body: CompletionRequest, model: str, metrics: Metrics,
                 arrived: float):
        self.engine, self.job, self.events, self.body, self.model = engine, job, events, body, model
        self.metrics, self.arrived = metrics, arrived
        self.id = protocol.new_id("cmpl")
        self.created = int(time.time())
        self.last_token_at = None
        self.done = False
        self.with_logprobs = body.logprobs is not None
        self.with_ids = bool(body.return_token_ids)
        self.echoed = 0  # the length of the echoed prompt's text: the completion's text offsets run on from it

    def _timing(self, out):
        """Latencies by when the engine made the tokens: a reader that gets several at once does not shorten them."""
        if self.last_token_at is None:
            self.metrics.ttft.observe(out.produced - self.arrived)
        else:
            self.metrics.itl.observe(out.produced - self.last_token_at)
        self.last_token_at = out.produced

    def _token_entry(self, out) -> dict:
        return {"piece": out.piece, "logprob": out.logprob, "top": out.top, "offset": self.echoed + out.offset}

    def _prompt(self, outs) -> tuple[str, list[dict]]:
        """The echoed prompt's text and logprobs entries; the completion's offsets then follow its text."""
        text, tokens = "".join(o.text for o in outs), [self._token_entry(o) for o in outs]
        self.echoed = len(text)
        return text, tokens

    def _finished(self, payload) -> dict:
        self.done = True
        self.events.tally.end(payload["finish_reason"])
        return protocol.usage(payload["prompt_tokens"], payload["completion_tokens"])

    def _failed(self, error):
        self.done = True
        self.events.tally.end("cancelled" if getattr(error, "status", None) == 499 else "error")

    async def _next_events(self) -> list:
        """The next event and every other one already waiting (a slow reader gets them together)."""
        events = [await self.events.queue.get()]
        while not self.events.queue.empty():
            events.append(self.events.queue.get_nowait())
        return events

    def _chunk(self, outs) -> dict:
        tokens = [self._token_entry(o) for o in outs] if self.with_logprobs else None
        ids = [o.token for o in outs] if self.with_ids else None
        return protocol.chunk(self.id, self.model, self.created, "".join(o.text for o in outs), None, tokens, ids)

    async def sse(self):
        """Server-sent events: one chunk per token, or one for all the tokens that were waiting (the text, the
        logprobs and the token ids of each in order), then the finish, the usage if asked, and [DONE]."""
        try:
            while True:
                outs = []
                for kind, payload in await self._next_events():
                    if kind == "prompt":  # the echoed prompt's chunk, before any token's
                        text, tokens = self._prompt(payload)
                        yield {"data": json.dumps(protocol.chunk(self.id, self.model, self.created, text, None,
                                                                 tokens if self.with_logprobs else None, None))}
                        continue
                    if kind == "token":
                        self._timing(payload)
                        outs.append(payload)
                        continue
                    if outs:
                        yield {"data": json.dumps(self._chunk(outs))}
                        outs = []
                    if kind == "done":
                        usage = self._finished(payload)
                        yield {"data": json.dumps(protocol.chunk(self.id, self.model, self.created, "",
                                                                 payload["finish_reason"], None, None))}
                        if self.body.stream_options is not None and self.body.stream_options.include_usage:
                            yield {"data": json.dumps(protocol.usage_chunk(self.id, self.model, self.created,
                                                                           usage))}
                    else:
                        self._failed(payload)
                        yield {"data": json.dumps(payload.body())}
                    yield {"data": "[DONE]"}
                    return
                if outs and (self.with_logprobs or self.with_ids or any(o.text for o in outs)):
                    yield {"data": json.dumps(self._chunk(outs))}
        finally:
            if not self.done:  # the client went away (or the server is stopping): free the row
                self.engine.cancel(self.job)
            self.events.tally.end("cancelled")  # unless it ended otherwise

    async def collect(self, request: Request):
        watcher = asyncio.create_task(self._watch_disconnect(request))
        text, tokens, ids = [], [], []
        try:
            while True:
                kind, payload = await self.events.queue.get()
                if kind == "prompt":
                    echoed, entries = self._prompt(payload)
                    text.append(echoed)
                    tokens.extend(entries)
                elif kind == "token":
                    self._timing(payload)
                    text.append(payload.text)
                    tokens.append(self._token_entry(payload))
                    ids.append(payload.token)
                elif kind == "done":
                    usage = self._finished(payload)
                    return JSONResponse(protocol.completion(
                        self.id, self.model, "".join(text), payload["finish_reason"], usage,
                        tokens if self.with_logprobs else None, ids if self.with_ids else None, self.body.session_id))
                else:
                    self._failed(payload)
                    raise payload
        finally:
            watcher.cancel()
            if not self.done:
                self.engine.cancel(self.job)
            self.events.tally.end("cancelled")  # unless it ended otherwise

    async def _watch_disconnect(self, request: Request):
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.engine.cancel(self.job)
                self.events.emit("error", ApiError(499, "the client closed the connection"))
                return
