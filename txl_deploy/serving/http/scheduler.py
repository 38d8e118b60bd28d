"""The in-process engine: every running request and every session is a row of one batched memory over the loaded
`TxlRuntime`'s backend, advanced by one engine thread in continuous batching. Knows nothing of HTTP.

Why one thread: the backend advances every row of a call by the same segment, so the engine alone decides which
rows go into each call (decode steps between prompt chunks), and alone touches the memory; HTTP handlers only queue
work for it. docs/serving.md (how requests are batched; limits, errors, shutdown) says what a turn does, why a
session continued request after request equals one stream, and what happens when a step fails.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.contract.clusters import Clusters
from txl_deploy.runtimes.saved_state import SavedState, read_saved_state, state_bytes
from txl_deploy.serving.http.batch_steps import BatchSteps, internal_error
from txl_deploy.serving.http.engine import EngineCore, Job
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.sessions import LOADING, PARKING, Session
from txl_deploy.serving.rows import RowPool, SeparateStates, row_bytes, row_store

__all__ = ["EngineBroken", "Job", "Scheduler"]

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.5  # how long the idle engine sleeps between looks at the session TTLs


class Scheduler(EngineCore, BatchSteps):
    """The engine: `start()`, then `submit(job)` from any thread; `stop()` finishes or cancels what runs."""

    def __init__(self, runtime: TxlRuntime, max_batch: int = 16, max_sessions: int = 64,
                 session_ttl: float | None = 3600.0, max_queue: int = 64, prefill_chunk: int | None = None,
                 lazy: bool = False):
        if runtime.vocab is None:
            raise InputError("this model has no vocabulary: the server needs one to read and write text")
        self.rt = runtime
        self.backend = runtime.backend
        self.mem_len = runtime.mem_len
        self.rows, max_sessions = _row_store(self.backend, int(max_batch), int(max_sessions))
        super().__init__(runtime.vocab, runtime.n_token, max_batch, max_sessions, session_ttl, max_queue)
        self.clusters = Clusters.of(runtime.config)  # the adaptive softmax's, as TxlRuntime.generate samples
        # head first, tails as the decisions ask, where the backend has the parts (docs/serving.md)
        self.lazy = bool(lazy) and self.backend.clusters is not None
        if lazy and not self.lazy:
            logger.info("lazy decoding needs an adaptive softmax's head and tail graphs (an ONNX export beside its "
                        "parts); this model has none, so every step computes the full distribution")
        # lazy decisions made, and per tail cluster how many rows it was computed for (TxlRuntime.tail_stats's form)
        self.tail_stats = {"decisions": 0, "tails": [0] * (self.clusters.n_clusters if self.lazy else 0)}
        self.prefill_chunk = int(prefill_chunk or self.backend.max_segment)
        if not 1 <= self.prefill_chunk <= self.backend.max_segment:
            raise InputError(f"prefill_chunk must be in [1, {self.backend.max_segment}] (the model's max_segment), "
                             f"got {prefill_chunk}")
        self.batched = isinstance(self.rows, RowPool)
        self.bytes_per_session = row_bytes(self.backend) + 4 * self.n_token  # the memory + the last log-probs
        self._inbox = collections.deque()
        self._wake = threading.Event()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._stopping = False
        self._ended = False  # set (under the lock) once the engine takes nothing more
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
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._ended

    def start(self):
        self._thread.start()

    def _enqueue(self, job: Job):
        self._post(("job", job))

    def cancel(self, job: Job):
        """The client went away: the job's rows (its choices' too) are freed at the engine's next turn."""
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

    def beam_search(self, ids, **options) -> list:
        """`TxlRuntime.beam_search(ids, **options)` on the loaded runtime's own memory (the pool's rows are not
        touched), run in the engine thread between two steps: the batch waits while it runs. Blocks: call it from
        a worker thread."""
        def search():
            try:
                return self.rt.beam_search(ids, **options)
            finally:
                self.rt.reset()  # the runtime's memory held the prompt: let it go

        return self.call(search).result()

    def _shut_down(self, timeout: float):
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._post(("abort", None))
            self._thread.join(10)

    def _post(self, item):
        self._inbox.append(item)
        self._wake.set()

    # -- sessions' memories: rows, touched in the engine thread only ----------------------------------------------
    def _park_bytes(self, session: Session) -> bytes:
        """The bytes of a `TxlRuntime.save_state` .npz of the session's row, copied out between two steps."""
        state = self.call(lambda: self._read_row(session)).result()
        last = None if state["last"] is None else state["last"][None]
        return state_bytes(self.backend, state["arrays"], last)

    def _check_state(self, blob: bytes) -> SavedState:
        """Parked bytes read as the untrusted input they are (runtimes/saved_state.py: one row at most, names,
        headers, sizes and the model's fingerprint checked before any tensor is read)."""
        try:
            return read_saved_state(bytes(blob), self.backend, max_rows=1)
        except InputError as e:
            raise ApiError(400, f"not a state of this model: {str(e).splitlines()[0]}", code="invalid_state") from None

    def _load_state(self, session: Session, state: SavedState):
        def load():
            if session.state != LOADING:
                raise ApiError(409, f"session {session.id!r} ended while it was being restored", code="session_gone")
            handle = self.rows.start()
            try:
                self.rows.load(handle, state.arrays)
            except BaseException:
                self.rows.release(handle)
                raise
            session.handle = handle
            last = state.last_log_probs
            session.last_log_probs = None if last is None else last.reshape(-1)
            count = state.arrays.get(io_spec.MEM_COUNT)
            session.tokens = int(count[0]) if count is not None else 0

        self.call(load).result()

    def _copy_session(self, source: Session, fork: Session):
        """The fork's row takes a copy of the source's (Backend.copy_rows), between two steps."""
        def copy():
            if fork.state != LOADING:
                raise ApiError(409, f"session {fork.id!r} ended while it was being forked", code="session_gone")
            if source.handle is None:  # nothing fed yet: the fork is as empty
                return
            handle = self.rows.start()
            try:
                self.rows.copy(source.handle, [handle])
            except BaseException:
                self.rows.release(handle)
                raise
            fork.handle = handle
            fork.last_log_probs = None if source.last_log_probs is None else np.array(source.last_log_probs)

        self.call(copy).result()

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
            self._admit_waiting()
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
                self._fail(job, internal_error(e, "the engine failed a step"))
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
            running = internal_error(failure, "the engine stopped")
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
            self._notify_failure(failure)

    def _answer(self, job: Job, error: ApiError):
        """_fail, for a state that may be broken: the client hears the error whatever the bookkeeping does."""
        try:
            self._fail(job, error)
        except Exception:  # noqa: BLE001 - the engine is stopping: answering the client is what is left
            if job in self._running:
                self._running.remove(job)
            self._emit(job, "error", error)

    def _take_inbox(self):
        while self._inbox:
            kind, item = self._inbox.popleft()
            if kind == "job":
                self._waiting.append(item)
            elif kind == "cancel":
                for job in (item, *item.kids):
                    job.cancelled = True
                    self._cancelled(job)
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

    def _expire(self):
        now = time.monotonic()
        if now - self._last_expiry >= 1.0:
            self._last_expiry = now
            self.sessions.expire()


def _row_store(backend, max_batch: int, max_sessions: int):
    """(the store of every stream's memory, the sessions it leaves room for). A row per running request and per
    session; but a backend whose programs run batches of at most `backend.max_batch` rows (an ExecuTorch program's
    memory plan) holds its pool in one state of at most that many, so the sessions get what the requests leave."""
    limit = getattr(backend, "max_batch", None)
    wanted = max_batch + max_sessions
    rows = row_store(backend, wanted if limit is None else min(wanted, int(limit)))
    if not isinstance(rows, RowPool):  # one state of one row per stream: the batch limit bounds no pool
        return (rows if rows.size == wanted else SeparateStates(backend, wanted)), max_sessions
    if rows.size >= wanted:
        return rows, max_sessions
    if max_batch >= rows.size:
        raise InputError(f"this model runs batches of at most {rows.size} rows (as it was exported): "
                         f"--max-batch {max_batch} leaves no row for a session; pass --max-batch {rows.size // 2} "
                         "or export it for larger batches")
    logger.warning("this model runs batches of at most %d rows (as it was exported): serving %d running requests "
                   "and at most %d sessions (not %d); export it for larger batches to hold more", rows.size,
                   max_batch, rows.size - max_batch, max_sessions)
    return rows, rows.size - max_batch


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


class _Abort(Exception):
    """stop() ran out of time: fail what is left."""


class EngineBroken(RuntimeError):
    """The engine's own state is no longer consistent (rows): it cannot go on."""


