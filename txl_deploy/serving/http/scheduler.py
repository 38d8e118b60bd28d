"""Continuous batching of many streams over one batched runtime, in one engine thread. Knows nothing of HTTP.

Every running request is a row of one batched memory (`serving/rows.py`'s RowPool over the loaded TxlRuntime's
backend); a session keeps its row between requests. The runtime advances every row of a call by the same segment
length Q, and a token fed enters the memory for good (a shorter segment cannot be padded), so the scheduler never
mixes lengths in a call. Each turn of the engine loop:

1. takes in what arrived (requests, session commands, cancellations) and frees the rows of cancelled requests:
   a client that disconnects frees its row before the next step;
2. admits waiting requests while fewer than `max_batch` run (they join between steps);
3. runs ONE decode call for every row that has a token to feed (Q = 1: the token sampled last turn), then samples
   each row's next token from the log-probs (the shared sampler, `runtimes/sampling.py`);
4. runs ONE prompt call: the next chunk (at most `prefill_chunk` tokens) of the requests still feeding their prompt,
   those whose chunks have the same length together (usually every full chunk), the oldest request's group first.
   So a long prompt goes in between decode steps and the running streams wait at most one chunk per token.

Rows join and leave between calls; the rows of a call that are not contiguous are run as RowPool spans (views, no
copy). A request ends when the sampler says so (stop string, stop token, max_tokens); a session request then feeds
its last token too, so the session's memory holds everything generated, exactly as `TxlRuntime.generate` leaves
it: a session continued request after request gives the log-probs of one long stream fed the same segments.

Threads: HTTP handlers call `submit`, `cancel` and the session methods from the event loop; these only take a
short lock or queue a command; the engine thread alone touches the memory and the rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import os
import tempfile
import threading
import time
from typing import Callable

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.errors import InputError, TxlError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.http.completion import Completion, TokenOut
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.sessions import GONE, PARKED, Session, SessionStore
from txl_deploy.serving.rows import RowPool, row_bytes, row_store

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle engine sleeps between looks at the session TTLs


class Job:
    """One completion request as the engine sees it. `emit(kind, payload)` is called from the engine thread:
    ("token", TokenOut), ("done", {"finish_reason", "prompt_tokens", "completion_tokens"}) or ("error", ApiError)."""

    def __init__(self, prompt: np.ndarray, params, emit: Callable[[str, object], None], session_id: str | None = None):
        self.prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        self.params, self.emit, self.session_id = params, emit, session_id
        self.cancelled = False
        self.session: Session | None = None
        self.handle = None  # the row
        self.fed = 0  # prompt tokens fed
        self.pending: int | None = None  # a sampled token not fed yet
        self.log_probs = None  # next-token log-probs after the last call
        self.finishing = False  # only the last token is left to feed (sessions), nothing more to send
        self.completion: Completion | None = None
        self.admitted = 0.0

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt.size


class Scheduler:
    """The engine: `start()`, then `submit(job)` from any thread; `stop()` finishes or cancels what runs."""

    def __init__(self, runtime: TxlRuntime, max_batch: int = 16, max_sessions: int = 64,
                 session_ttl: float | None = 3600.0, max_queue: int = 64, prefill_chunk: int | None = None,
                 on_batch: Callable[[int], None] | None = None):
        if runtime.vocab is None:
            raise InputError("this model has no vocabulary: the server needs one to read and write text")
        self.rt = runtime
        self.backend = runtime.backend
        self.vocab, self.n_token, self.mem_len = runtime.vocab, runtime.n_token, runtime.mem_len
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.prefill_chunk = int(prefill_chunk or self.backend.max_segment)
        if not 1 <= self.prefill_chunk <= self.backend.max_segment:
            raise InputError(f"prefill_chunk must be in [1, {self.backend.max_segment}] (the model's max_segment), "
                             f"got {prefill_chunk}")
        self.rows = row_store(self.backend, self.max_batch + int(max_sessions))
        self.batched = isinstance(self.rows, RowPool)
        self.bytes_per_session = row_bytes(self.backend) + 4 * self.n_token  # the memory + the last log-probs
        self.sessions = SessionStore(int(max_sessions), session_ttl, self._dropped)
        self.on_batch = on_batch or (lambda n: None)
        self._inbox = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._queued = 0
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._stopping = False
        self.draining = False
        self._thread = threading.Thread(target=self._loop, name="txl-serve-engine", daemon=True)
        self._last_expiry = 0.0

    @classmethod
    def load(cls, model, threads: int | None = None, backend: str | None = None, providers=None,
             **options) -> "Scheduler":
        """Load MODEL (as `TxlRuntime.load` does) and build the engine over it; logs what a session costs."""
        engine = cls(TxlRuntime.load(model, backend=backend, providers=providers, threads=threads), **options)
        engine.describe()
        return engine

    def describe(self):
        per, cap = self.bytes_per_session, self.sessions.max_sessions
        how = ("the rows of one batched memory, one backend call per step" if self.batched else
               f"one memory per stream, run one after another (the {self.backend.name} backend's state is not "
               "host arrays)")
        logger.info("model: %s backend, %d layers, mem_len %d, %d tokens in the vocabulary, max_segment %d",
                    self.backend.name, self.rt.config.n_layer, self.mem_len, self.n_token, self.backend.max_segment)
        logger.info("memory per session: %s (the model's memory of %d tokens and the last log-probs); %d sessions "
                    "and %d running requests at most: %s", _mib(per), self.mem_len, cap, self.max_batch,
                    _mib(per * (cap + self.max_batch)))
        logger.info("streams: %s; prompts fed in chunks of %d tokens", how, self.prefill_chunk)

    # -- what other threads call ---------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self):
        self._thread.start()

    def submit(self, job: Job):
        """Queue a request, or raise ApiError at once (429 queue full, 503 draining, 404/409 session)."""
        job.params.check_vocabulary(self.n_token)
        with self._lock:
            admit(job, self.sessions, self.draining, self._queued, self.max_queue)
            self._queued += 1
        self._post(("job", job))

    def cancel(self, job: Job):
        """The client went away: the job's row is freed at the engine's next turn."""
        job.cancelled = True
        self._post(("cancel", job))

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn() in the engine thread between two steps; its result or exception in the future."""
        if not self._thread.is_alive():
            raise ApiError(503, "the engine is not running", type="server_error", code="engine_stopped")
        future = concurrent.futures.Future()
        self._post(("call", (fn, future)))
        return future

    def stop(self, timeout: float = 30.0):
        """Stop taking requests, let the running and waiting ones finish (at most `timeout` seconds), then end."""
        with self._lock:
            self.draining = True
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._post(("abort", None))
            self._thread.join(10)

    def _post(self, item):
        self._inbox.append(item)
        self._wake.set()

    # -- sessions (the HTTP side's requests, run in the engine thread where they touch the memory) ----------------
    def create_session(self, id_: str | None = None) -> Session:
        return self.sessions.create(id_)

    def delete_session(self, id_: str):
        self.sessions.remove(id_, f"was deleted; {GONE}")

    def park(self, id_: str) -> bytes:
        """The session's memory as the bytes of a `TxlRuntime.save_state` .npz; the session ends. Blocks until the
        engine has copied the row out (between two steps): call it from a worker thread."""
        session = self.sessions.remove(id_, PARKED, notify=False)
        return _npz_bytes(self.rt, self.call(lambda: self._take_row(session)).result())

    def restore(self, id_: str | None, blob: bytes) -> Session:
        """A new session from parked bytes; refused (400) when they are not a state of this model. Blocks: call it
        from a worker thread."""
        state = _read_state(self.rt, blob)  # checked before a session is made
        session = self.sessions.create(id_)

        def restore():
            session.handle = self.rows.start()
            self.rows.load(session.handle, state["arrays"])
            session.last_log_probs, session.tokens = state["last"], state["tokens"]
            return session
        try:
            return self.call(restore).result()
        except Exception:
            self.sessions.remove(session.id, "could not be restored")
            raise

    def _dropped(self, session: Session, why: str):
        # called by the store (any thread): the row goes back to the pool in the engine thread
        if session.handle is not None:
            handle, session.handle = session.handle, None
            self._post(("release", handle))

    def _take_row(self, session: Session) -> dict:
        if session.handle is None:
            raise ApiError(400, f"session {session.id!r} has no memory yet: nothing to park", param="session_id")
        arrays = self.rows.save(session.handle)
        self.rows.release(session.handle)
        session.handle = None
        return {"arrays": arrays, "last": session.last_log_probs}

    # -- the engine thread --------------------------------------------------------------------------------------
    def _loop(self):
        try:
            while True:
                self._take_inbox()
                self._admit()
                if not self._running:
                    if self._stopping and not self._waiting:
                        return
                    self._expire()
                    self._wake.wait(IDLE_WAIT_S)
                    self._wake.clear()
                    continue
                self._decode()
                self._prefill()
                self._expire()
        except _Abort:
            for job in list(self._running) + list(self._waiting):
                self._fail(job, ApiError(503, "the server stopped before this request finished", type="server_error",
                                         code="shutdown"))
        except Exception:  # noqa: BLE001 - a bug must fail the requests, not hang them
            logger.exception("the engine stopped")
            for job in list(self._running) + list(self._waiting):
                self._fail(job, ApiError(500, "the engine stopped on an internal error", type="server_error"))

    def _take_inbox(self):
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "job":
                self._waiting.append(item)
            elif kind == "cancel":
                self._cancelled(item)
            elif kind == "release":
                self.rows.release(item)
            elif kind == "call":
                fn, future = item
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
            elif kind == "abort":
                raise _Abort()

    def _cancelled(self, job: Job):
        if job in self._waiting:
            self._waiting.remove(job)
            with self._lock:
                self._queued -= 1
            self._end(job, None)
        elif job in self._running and not job.finishing:
            if job.session is not None and job.pending is not None:
                job.finishing = True  # the session's memory takes the token already sampled (and sent)
            else:
                self._end(job, None)

    def _admit(self):
        while self._waiting and len(self._running) < self.max_batch:
            job = self._waiting.popleft()
            with self._lock:
                self._queued -= 1
            try:
                if job.session is not None:
                    if job.session.handle is None:
                        job.session.handle = self.rows.start()
                    job.handle = job.session.handle
                else:
                    job.handle = self.rows.start()
                job.completion = Completion(job.params, self.vocab, self.n_token, context=job.prompt)
            except TxlError as e:
                self._fail(job, e)
                continue
            job.admitted = time.monotonic()
            self._running.append(job)
            if not job.prompt.size:  # a session continued without a prompt
                job.log_probs = job.session.last_log_probs
                self._after_log_probs(job)

    def _run(self, jobs: list[Job], tokens: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].handle if self.batched else 0)
        jobs[:] = [jobs[i] for i in order]
        try:
            return self.rows.run([j.handle for j in jobs], tokens[order], positions[order])
        except Exception as e:  # the backend commits nothing on failure: every memory is as it was
            logger.exception("a batched call failed")
            for job in jobs:
                self._fail(job, ApiError(500, f"the model failed on this batch: {e}", type="server_error"))
            return None

    def _decode(self):
        jobs = [j for j in self._running if j.pending is not None]
        if not jobs:
            return
        tokens = np.array([[j.pending] for j in jobs], dtype=np.int64)
        log_probs = self._run(jobs, tokens, np.zeros((len(jobs), 1), dtype=np.int64))
        if log_probs is None:
            return
        self.on_batch(len(jobs))
        for i, job in enumerate(jobs):
            job.pending, job.log_probs = None, log_probs[i, 0]
            if job.session is not None:
                job.session.tokens += 1
            if job.finishing:
                self._end(job, job.completion.finish)
            else:
                self._after_log_probs(job)

    def _prefill(self):
        feeding = [j for j in self._running if j.prefilling and j.pending is None and not j.finishing]
        if not feeding:
            return
        length = lambda j: min(self.prefill_chunk, j.prompt.size - j.fed)  # noqa: E731
        q = length(min(feeding, key=lambda j: j.admitted))
        jobs = [j for j in feeding if length(j) == q]
        tokens = np.stack([j.prompt[j.fed:j.fed + q] for j in jobs])
        log_probs = self._run(jobs, tokens, np.full((len(jobs), 1), q - 1, dtype=np.int64))
        if log_probs is None:
            return
        for i, job in enumerate(jobs):
            job.fed += q
            if job.session is not None:
                job.session.tokens += q
            if not job.prefilling:
                job.log_probs = log_probs[i, 0]
                self._after_log_probs(job)

    def _after_log_probs(self, job: Job):
        """Sample the next token (or finish) from job.log_probs."""
        if job.cancelled:
            self._end(job, None)
            return
        completion = job.completion
        if completion.finish is not None:  # max_tokens 0: only the prompt was fed
            self._end(job, completion.finish)
            return
        try:
            out: TokenOut = completion.next(job.log_probs)
        except TxlError as e:
            self._fail(job, e)
            return
        job.emit("token", out)
        job.pending = out.token
        if completion.finish is not None:
            if job.session is not None:
                job.finishing = True  # fed at the next decode call, then done
            else:
                self._end(job, completion.finish)

    def _end(self, job: Job, finish_reason: str | None):
        if job in self._running:
            self._running.remove(job)
        if job.session is not None:
            complete = job.pending is None and not job.prefilling and job.log_probs is not None
            # the next-token log-probs of what the memory holds; a request cut short mid-prompt has none
            job.session.last_log_probs = np.array(job.log_probs, dtype=np.float32) if complete else None
            self.sessions.release(job.session)
        elif job.handle is not None:
            self.rows.release(job.handle)
        job.handle = None
        if finish_reason is not None and not job.cancelled:
            job.emit("done", {"finish_reason": finish_reason, "prompt_tokens": int(job.prompt.size),
                              "completion_tokens": job.completion.generated})

    def _fail(self, job: Job, error: Exception):
        if job in self._running:
            self._running.remove(job)
        if job.session is not None:
            job.session.last_log_probs = None
            self.sessions.release(job.session)
        elif job.handle is not None:
            self.rows.release(job.handle)
        job.handle = None
        if not isinstance(error, ApiError):
            error = ApiError(400, str(error))
        job.emit("error", error)

    def _expire(self):
        now = time.monotonic()
        if now - self._last_expiry >= 1.0:
            self._last_expiry = now
            self.sessions.expire()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


class _Abort(Exception):
    """stop() ran out of time: fail what is left."""


# -- parked states: TxlRuntime's own writer and reader ------------------------------------------------------------
def _npz_bytes(rt: TxlRuntime, state: dict) -> bytes:
    """One row's memory as the bytes of the .npz `TxlRuntime.save_state(path)` writes (via a scratch runtime on the
    same backend, so the format is the runtime's own)."""
    arrays = dict(state["arrays"], __fingerprint__=np.array(rt.backend.fingerprint()))
    if state["last"] is not None:
        arrays["__last_log_probs__"] = np.asarray(state["last"], dtype=np.float32)[None]
    scratch = TxlRuntime(rt.backend)  # shares the backend: never closed
    scratch.load_state(arrays)
    with tempfile.TemporaryDirectory(prefix="txl-park-") as tmp:
        path = os.path.join(tmp, "state.npz")
        scratch.save_state(path)
        with open(path, "rb") as f:
            return f.read()


def _read_state(rt: TxlRuntime, blob: bytes) -> dict:
    """Parked bytes -> {"arrays" of one row, "last" log-probs, "tokens"}, read by `TxlRuntime.load_state` as the
    untrusted input they are (one row at most, names, headers, sizes and the model's fingerprint checked before any
    tensor is read); ApiError 400 when they are not a state of this model."""
    scratch = TxlRuntime(rt.backend)
    try:
        scratch.load_state(bytes(blob), max_rows=1)
    except InputError as e:
        raise ApiError(400, f"not a state of this model: {str(e).splitlines()[0]}", code="invalid_state") from None
    if scratch.batch_size != 1:
        raise ApiError(400, f"a session's state holds one memory row, this one holds {scratch.batch_size}",
                       code="invalid_state")
    saved = scratch.save_state()
    arrays = {k: v for k, v in saved.items() if not k.startswith("__")}
    last = saved.get("__last_log_probs__")
    count = arrays.get(io_spec.MEM_COUNT)
    return {"arrays": arrays, "last": None if last is None else np.asarray(last, np.float32).reshape(-1),
            "tokens": int(count[0]) if count is not None else 0}


def admit(job: Job, sessions, draining: bool, queued: int, max_queue: int):
    """The checks a request passes before it is queued, under the caller's lock (the in-process scheduler's and
    the Triton fleet's alike): raises ApiError (503 draining, 429 queue full, 404/409 session, 400 nothing to
    continue); on success `job.session` is the acquired session, if the request names one."""
    if draining:
        raise ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                       code="draining")
    if queued >= max_queue:
        raise ApiError(429, f"the server is busy: {queued} requests are waiting (--max-queue {max_queue}); retry "
                            "later", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    if job.session_id is not None:
        job.session = sessions.acquire(job.session_id)
        if not job.prompt.size and job.session.last_log_probs is None:
            sessions.release(job.session)
            raise ApiError(400, f"session {job.session_id!r} has no text yet: send a prompt", param="prompt")
    elif not job.prompt.size:
        raise ApiError(400, "the prompt is empty (only a session can be continued without one)", param="prompt")
