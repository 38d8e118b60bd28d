"""Continuous batching of many streams over one batched runtime, in one engine thread. Knows nothing of HTTP.

Every running request is a row of one batched memory (`serving/rows.py`'s RowPool over the loaded TxlRuntime's
backend); a session keeps its row between requests. The runtime advances every row of a call by the same segment
length Q, and a token fed enters the memory for good (a shorter segment cannot be padded), so the scheduler never
mixes lengths in a call. Each turn of the engine loop:

1. takes in what arrived (requests, session commands, cancellations) and frees the rows of cancelled requests:
   a client that disconnects frees its row before the next step;
2. admits waiting requests while fewer than `max_batch` run (they join between steps);
3. runs ONE decode call for every row that has a token to feed (Q = 1: the token sampled last turn), then samples
   each row's next token from the log-probs (the shared sampler, `runtimes/sampling/`);
4. runs ONE prompt call: the next chunk (at most `prefill_chunk` tokens) of the requests still feeding their prompt,
   those whose chunks have the same length together (usually every full chunk), the oldest request's group first.
   So a long prompt goes in between decode steps and the running streams wait at most one chunk per token.

Lazy decoding (`lazy=True`, `txl-deploy serve --lazy`), on a backend that computes an adaptive softmax's head and
tails apart (`backend.clusters`): a decode call, and a prompt's last chunk, compute the head only; the rows'
samplers decide on it together and each tail cluster some of them need is computed once, for those rows
(`runtimes/lazy_decode.decide`). That is TxlRuntime.generate's path, with its numbers: a request gets generate's
tokens. A prompt's other chunks run the full graph at their last position, as generate's earlier segments do, so
a prompt call holds either last chunks or others. A session's next-token distribution (to continue it without a
prompt, or to park it) is composed from the head and every tail once its request ends. The log-probs sent are then
the parts' numbers, which can differ from the full graph's in the last bit: without `lazy` every step computes the
full distribution, whose numbers a session's log-probs match bit for bit (docs/serving.md).

Rows join and leave between calls; the rows of a call that are not contiguous are run as RowPool spans (views, no
copy). A request ends when the sampler says so (stop string, stop token, max_tokens); a session request then feeds
its last token too, so the session's memory holds everything generated, exactly as `TxlRuntime.generate` leaves
it: a session continued request after request gives the log-probs of one long stream fed the same segments.

Threads: HTTP handlers call `submit`, `cancel` and the session methods from the event loop; these only take a
short lock or queue a command; the engine thread alone touches the memory and the rows, and alone gives a session a
row or takes it back (a session that is gone is told to the engine, which frees its row between two steps). The
session's states (`sessions.py`) decide what may happen to it meanwhile: a row is only ever given to a session that
is being restored or runs a request, and such a session cannot be taken away.

Failures: an exception in a step fails the requests it concerns with a 500 in OpenAI's shape (a failed batched call,
its rows' requests; a failed admission or sampling, that request; anything else, every running request), then the
engine checks its state (every row free or used once, every running request's and session's row in use). If that
holds it goes on; if not it stops: `failure` is the exception, `alive` is False, every request running, waiting or
still in the inbox is answered, new ones get 503, and `on_failure(exception)` is called (the server exits on it).
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
from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError, TxlError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.lazy_decode import decide, full_log_probs
from txl_deploy.serving.http.completion import Completion, TokenOut
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.sessions import GONE, LOADING, PARKING, Session, SessionStore
from txl_deploy.serving.rows import PartialRun, RowPool, row_bytes, row_store

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
        self.parts = None  # lazy decoding: (hidden [d_model], head [H]) after the last call, in place of log_probs
        self.finishing = False  # only the last token is left to feed (sessions), nothing more to send
        self.completion: Completion | None = None
        self.admitted = 0.0
        self.touched = False  # the memory has taken tokens of this request

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt.size


class Scheduler:
    """The engine: `start()`, then `submit(job)` from any thread; `stop()` finishes or cancels what runs."""

    def __init__(self, runtime: TxlRuntime, max_batch: int = 16, max_sessions: int = 64,
                 session_ttl: float | None = 3600.0, max_queue: int = 64, prefill_chunk: int | None = None,
                 on_batch: Callable[[int], None] | None = None, lazy: bool = False):
        if runtime.vocab is None:
            raise InputError("this model has no vocabulary: the server needs one to read and write text")
        self.rt = runtime
        self.backend = runtime.backend
        self.vocab, self.n_token, self.mem_len = runtime.vocab, runtime.n_token, runtime.mem_len
        self.clusters = Clusters.of(runtime.config)  # the adaptive softmax's, as TxlRuntime.generate samples
        # head first, tails as the decisions ask, where the backend has the parts (see the module's docstring)
        self.lazy = bool(lazy) and self.backend.clusters is not None
        if lazy and not self.lazy:
            logger.info("lazy decoding needs an adaptive softmax's head and tail graphs (an ONNX export beside its "
                        "parts); this model has none, so every step computes the full distribution")
        # lazy decisions made, and per tail cluster how many rows it was computed for (TxlRuntime.tail_stats's form)
        self.tail_stats = {"decisions": 0, "tails": [0] * (self.clusters.n_clusters if self.lazy else 0)}
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
        self._ended = False  # set (under the lock) once the engine takes nothing more
        self.failure: BaseException | None = None  # what stopped the engine, if anything did
        self.on_failure: Callable[[BaseException], None] = lambda e: None
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
        if self.lazy:
            logger.info("decoding lazily: each step computes the adaptive softmax's head, and a tail only for the "
                        "rows whose decision needs it")

    # -- what other threads call ---------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        """The engine takes requests (started, and neither stopped nor failed)."""
        return self._thread.is_alive() and not self._ended

    def start(self):
        self._thread.start()

    def _not_running(self) -> ApiError:
        if self.failure is not None:
            return ApiError(503, f"the engine stopped on an internal error ({type(self.failure).__name__}): this "
                                 "server takes no more requests", type="server_error", code="engine_failed")
        return ApiError(503, "the engine is not running", type="server_error", code="engine_stopped")

    def submit(self, job: Job):
        """Queue a request, or raise ApiError at once (503 engine stopped or draining, 429 queue full, 404/409
        session)."""
        job.params.check_vocabulary(self.n_token)
        # Posted under the lock: once the engine has ended (under it too) nothing more is queued, so every request
        # that was is answered by the engine's last turn.
        with self._lock:
            if not self.alive:
                raise self._not_running()
            admit(job, self.sessions, self.draining, self._queued, self.max_queue)
            self._queued += 1
            self._post(("job", job))

    def cancel(self, job: Job):
        """The client went away: the job's row is freed at the engine's next turn."""
        job.cancelled = True
        self._post(("cancel", job))

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn() in the engine thread between two steps; its result or exception in the future."""
        future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise self._not_running()
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
        """The session's memory as the bytes of a `TxlRuntime.save_state` .npz; then the session ends. It ends only
        once the bytes exist: if they cannot be made (or it has no memory yet: 400), it stays as it was. Blocks
        until the engine has copied the row out (between two steps): call it from a worker thread."""
        session = self.sessions.begin_park(id_)
        parked = False
        try:
            blob = _npz_bytes(self.rt, self.call(lambda: self._read_row(session)).result())
            parked = True
            return blob
        finally:
            self.sessions.end_park(session, parked)

    def restore(self, id_: str | None, blob: bytes) -> Session:
        """A new session from parked bytes; refused (400) when they are not a state of this model. The session is
        `loading` (nothing may use it or take it away) until its row holds the state. Blocks: call it from a
        worker thread."""
        state = _read_state(self.rt, blob)  # checked before a session is made
        session = self.sessions.create(id_, loading=True)

        def load():
            if session.state != LOADING:
                raise ApiError(409, f"session {session.id!r} ended while it was being restored", code="session_gone")
            handle = self.rows.start()
            try:
                self.rows.load(handle, state["arrays"])
            except BaseException:
                self.rows.release(handle)
                raise
            session.handle = handle
            session.last_log_probs, session.tokens = state["last"], state["tokens"]
            self.sessions.loaded(session)
            return session
        try:
            return self.call(load).result()
        except BaseException:
            self.sessions.discard(session, f"could not be restored; {GONE}")
            raise

    def _dropped(self, session: Session, why: str):
        # called by the store (any thread, under its lock): the engine frees the row between two steps
        self._post(("drop", session))

    def _free_row(self, session: Session):
        handle, session.handle = session.handle, None
        if handle is not None:
            self.rows.release(handle)

    def _read_row(self, session: Session) -> dict:
        if session.state != PARKING:
            raise ApiError(409, f"session {session.id!r} is no longer being parked", code="session_gone")
        if session.handle is None:
            raise ApiError(400, f"session {session.id!r} has no memory yet: nothing to park (the session is kept)",
                           param="session_id")
        return {"arrays": self.rows.save(session.handle), "last": session.last_log_probs}

    # -- the engine thread --------------------------------------------------------------------------------------
    def _loop(self):
        failure = None
        try:
            while not self._turn():
                pass
        except _Abort:
            pass
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on: everything it holds is answered
            logger.exception("the engine stopped")
            failure = e
        finally:
            self._close(failure)

    def _turn(self) -> bool:
        """One turn of the loop; True once the engine has finished (stopping, and nothing is left to do)."""
        try:
            self._take_inbox()
            self._admit()
            if not self._running:
                if self._stopping and not self._waiting and not self._inbox:
                    return True
                self._expire()
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                return False
            self._decode()
            self._prefill()
            self._expire()
        except (_Abort, EngineBroken):
            raise
        except Exception as e:  # noqa: BLE001 - not one request's: which of the running ones it hit is unknown
            logger.exception("an engine step failed")
            for job in list(self._running):
                self._fail(job, _internal(e, "the engine failed a step"))
            self._check()
        return False

    def _check(self):
        """After a failure: go on only if the engine's state is intact (raises EngineBroken otherwise)."""
        problem = self._broken()
        if problem is not None:
            raise EngineBroken(problem)

    def _broken(self) -> str | None:
        if not self.rows.accounted():
            return "the memory rows are not accounted for (a row both free and used, or lost)"
        key = (lambda h: h) if self.batched else id
        used = {key(h) for h in self.rows.used}
        running = [key(j.handle) for j in self._running]
        if len(running) > self.max_batch:
            return f"{len(running)} requests are running, more than --max-batch {self.max_batch}"
        if len(set(running)) != len(running):
            return "two running requests share a row"
        held = running + [key(s.handle) for s in self.sessions.live() if s.handle is not None]
        if not set(held) <= used:
            return "a running request or a session holds a row that is free"
        return None

    def _close(self, failure: BaseException | None):
        """The engine's last act: nothing more is queued, and every request it holds is answered."""
        with self._lock:
            self._ended = True
            self.failure = failure
            leftover = list(self._inbox)
            self._inbox.clear()
        if failure is not None:
            running = _internal(failure, "the engine stopped")
            waiting = self._not_running()
        else:
            running = waiting = ApiError(503, "the server stopped before this request finished", type="server_error",
                                         code="shutdown")
        queued = list(self._waiting) + [item for kind, item in leftover if kind == "job"]
        self._waiting.clear()
        for job in list(self._running):
            self._answer(job, running)
        for job in queued:
            self._answer(job, waiting)
        for kind, item in leftover:
            if kind == "call" and item[1].set_running_or_notify_cancel():
                item[1].set_exception(waiting)
        with self._lock:
            self._queued = 0
        if failure is not None:
            try:
                self.on_failure(failure)
            except Exception:  # noqa: BLE001 - the engine has stopped either way
                logger.exception("on_failure failed")

    def _answer(self, job: Job, error: ApiError):
        """_fail, for a state that may be broken: the client hears the error whatever the bookkeeping does."""
        try:
            self._fail(job, error)
        except Exception:  # noqa: BLE001 - the engine is stopping: answering the client is what is left
            if job in self._running:
                self._running.remove(job)
            self._emit(job, "error", error)

    def _emit(self, job: Job, kind: str, payload):
        try:
            job.emit(kind, payload)
        except Exception:  # noqa: BLE001 - a client that cannot be told (its loop gone) must not stop the engine
            logger.exception("a request's event could not be delivered")
            job.cancelled = True

    def _take_inbox(self):
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "job":
                self._waiting.append(item)
            elif kind == "cancel":
                self._cancelled(item)
            elif kind == "drop":
                self._free_row(item)
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
                job.completion = Completion(job.params, self.vocab, self.n_token, context=job.prompt,
                                            clusters=self.clusters)
            except Exception as e:  # noqa: BLE001 - this request fails; the engine checks it can go on
                self._fail(job, e)
                self._check()
                continue
            job.admitted = time.monotonic()
            self._running.append(job)
            if not job.prompt.size:  # a session continued without a prompt
                job.log_probs = job.session.last_log_probs
                self._after_log_probs(job)

    def _run(self, jobs: list[Job], tokens: np.ndarray, positions: np.ndarray, head: bool = False):
        """One batched call: log-probs [B, P, V], or with head (hidden, head log-probs); None if it failed."""
        order = sorted(range(len(jobs)), key=lambda i: jobs[i].handle if self.batched else 0)
        jobs[:] = [jobs[i] for i in order]
        try:
            log_probs = self.rows.run([j.handle for j in jobs], tokens[order], positions[order], head=head)
        except Exception as e:  # noqa: BLE001 - the call's requests fail; the engine checks it can go on
            # the backend commits nothing on failure, but a call over several spans may have run some of them
            committed = e.committed if isinstance(e, PartialRun) else []
            cause = e.__cause__ if isinstance(e, PartialRun) else e
            logger.error("a batched call failed", exc_info=cause)
            for i in committed:
                jobs[i].touched = True
                if jobs[i].session is not None:
                    jobs[i].session.tokens += tokens.shape[1]
            for job in jobs:
                self._fail(job, ApiError(500, f"the model failed on this batch: {type(cause).__name__}: {cause}",
                                         type="server_error", code="model_error"))
            self._check()
            return None
        for job in jobs:
            job.touched = True
        return log_probs

    def _decode(self):
        jobs = [j for j in self._running if j.pending is not None]
        if not jobs:
            return
        tokens = np.array([[j.pending] for j in jobs], dtype=np.int64)
        out = self._run(jobs, tokens, np.zeros((len(jobs), 1), dtype=np.int64), head=self.lazy)
        if out is None:
            return
        self.on_batch(len(jobs))
        deciding = []
        for i, job in enumerate(jobs):
            job.pending = None
            self._took(job, out, i)
            if job.session is not None:
                job.session.tokens += 1
            if job.finishing:
                self._end(job, job.completion.finish)
            else:
                deciding.append(job)
        self._next_tokens(deciding)

    def _prefill(self):
        feeding = [j for j in self._running if j.prefilling and j.pending is None and not j.finishing]
        if not feeding:
            return
        length = lambda j: min(self.prefill_chunk, j.prompt.size - j.fed)  # noqa: E731
        last = lambda j: j.fed + length(j) == j.prompt.size  # noqa: E731 (the prompt's last chunk)
        oldest = min(feeding, key=lambda j: j.admitted)
        q, head = length(oldest), self.lazy and last(oldest)
        # lazy: last chunks compute the head (the first decision's), the others the full graph, never in one call
        jobs = [j for j in feeding if length(j) == q and (not self.lazy or last(j) == last(oldest))]
        tokens = np.stack([j.prompt[j.fed:j.fed + q] for j in jobs])
        out = self._run(jobs, tokens, np.full((len(jobs), 1), q - 1, dtype=np.int64), head=head)
        if out is None:
            return
        deciding = []
        for i, job in enumerate(jobs):
            job.fed += q
            if job.session is not None:
                job.session.tokens += q
            if not job.prefilling:
                self._took(job, out, i)
                deciding.append(job)
        self._next_tokens(deciding)

    @staticmethod
    def _took(job: Job, out, i: int):
        """Keep row i of a call's result at its last position: log-probs, or lazily the (hidden, head) pair."""
        if isinstance(out, tuple):
            job.parts, job.log_probs = (out[0][i, -1], out[1][i, -1]), None
        else:
            job.parts, job.log_probs = None, out[i, -1]

    def _next_tokens(self, jobs: list[Job]):
        """Sample each job's next token (or finish it): on its log-probs, or for the jobs holding the head, one
        lazy decision over all of them."""
        lazy = []
        for job in jobs:
            if self._over(job):
                continue
            if job.parts is None:
                self._sampled(job, job.completion.next, job.log_probs)
            else:
                lazy.append(job)
        if lazy:
            self._decide(lazy)

    def _decide(self, jobs: list[Job]):
        """The jobs' next tokens from their heads, each tail computed once for the rows whose decision needs it.
        A request whose sampling parameters leave no token fails alone; a failed tail fails the rows it was for."""
        refused = {}
        try:
            decision = decide(self.backend, [j.completion.sampler for j in jobs],
                              np.stack([j.parts[0] for j in jobs]), np.stack([j.parts[1] for j in jobs]),
                              failed=refused.__setitem__)
        except Exception as e:  # noqa: BLE001 - a tail graph failed: these requests fail, the engine goes on
            logger.error("a tail computation failed", exc_info=e)
            for job in jobs:
                self._fail(job, ApiError(500, f"the model failed on this batch: {type(e).__name__}: {e}",
                                         type="server_error", code="model_error"))
            self._check()
            return
        self.tail_stats["decisions"] += len(jobs) - len(refused)
        for i, rows in enumerate(decision.tail_rows):
            self.tail_stats["tails"][i] += int(rows)
        for r, job in enumerate(jobs):
            if r in refused:
                self._fail(job, refused[r])
                self._check()
            else:
                self._sampled(job, job.completion.decided, decision.choices[r])

    def _after_log_probs(self, job: Job):
        """Sample the next token (or finish) from job.log_probs."""
        if not self._over(job):
            self._sampled(job, job.completion.next, job.log_probs)

    def _over(self, job: Job) -> bool:
        """End the job instead of sampling if it was cancelled or is complete (max_tokens 0: only the prompt was
        fed)."""
        if job.cancelled:
            self._end(job, None)
            return True
        if job.completion.finish is not None:
            self._end(job, job.completion.finish)
            return True
        return False

    def _sampled(self, job: Job, choose, *args):
        """Send the token `choose(*args)` gives the job (or fail the job if it raises), and finish it if it was the
        last."""
        completion = job.completion
        try:
            out: TokenOut = choose(*args)
        except Exception as e:  # noqa: BLE001 - this request fails; the engine checks it can go on
            self._fail(job, e)
            self._check()
            return
        self._emit(job, "token", out)
        job.pending = out.token
        if completion.finish is not None:
            if job.session is not None:
                job.finishing = True  # fed at the next decode call, then done
            else:
                self._end(job, completion.finish)

    def _end(self, job: Job, finish_reason: str | None):
        self._let_go(job)
        if finish_reason is not None and not job.cancelled:
            self._emit(job, "done", {"finish_reason": finish_reason, "prompt_tokens": int(job.prompt.size),
                                     "completion_tokens": job.completion.generated})

    def _fail(self, job: Job, error: Exception):
        if not isinstance(error, ApiError):
            if isinstance(error, TxlError):
                error = ApiError(400, str(error))
            else:
                logger.error("a request failed", exc_info=error)
                error = _internal(error, "this request failed")
        self._let_go(job)
        self._emit(job, "error", error)

    def _let_go(self, job: Job):
        """The job is over: out of the batch, its session free again, its own row back in the pool."""
        if job in self._running:
            self._running.remove(job)
        if job.session is not None:
            if job.touched:  # a request that never ran (cancelled or refused in the queue) leaves the session as it was
                complete = job.pending is None and not job.prefilling and (job.log_probs is not None or
                                                                           job.parts is not None)
                # the next-token log-probs of what the memory holds; a request cut short mid-prompt has none
                job.session.last_log_probs = self._next_log_probs(job) if complete else None
            self.sessions.release(job.session)
        elif job.handle is not None:
            self.rows.release(job.handle)
        job.handle = None

    def _next_log_probs(self, job: Job) -> np.ndarray | None:
        """The job's next-token log-probs [V] (float32): kept, or composed from the head and every tail."""
        if job.parts is None:
            return np.array(job.log_probs, dtype=np.float32)
        hidden, head = job.parts
        try:
            return full_log_probs(self.backend, hidden[None], head[None])[0]
        except Exception:  # noqa: BLE001 - the session keeps its memory; it then needs a prompt to go on
            logger.exception("a session's next-token distribution could not be computed")
            return None

    def _expire(self):
        now = time.monotonic()
        if now - self._last_expiry >= 1.0:
            self._last_expiry = now
            self.sessions.expire()


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


class _Abort(Exception):
    """stop() ran out of time: fail what is left."""


class EngineBroken(RuntimeError):
    """The engine's own state is no longer consistent (rows): it cannot go on."""


def _internal(error: BaseException, what: str) -> ApiError:
    return ApiError(500, f"{what}: internal error ({type(error).__name__}: {error})", type="server_error",
                    code="internal_error")


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
