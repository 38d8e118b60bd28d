"""The engine the HTTP app talks to, and what its two kinds share: admission, the sessions' lifecycle, shutdown.

`Scheduler` (scheduler.py) runs the model in this process; `FleetEngine` (fleet.py) runs it on Triton servers.
Both are an `EngineCore`: the checks a request passes before it queues, the 503 a stopped engine answers, and the
order of a park (the bytes first, then the session ends) and a restore (the state checked, a `loading` session,
then its memory in place) live here once; each engine says how it queues a request, where a session's memory
lives and how it stops. The session states themselves are sessions.py's.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import logging
import threading
from typing import Callable

import numpy as np

from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.sessions import GONE, Session, SessionStore

logger = logging.getLogger(__name__)


class Job:
    """One completion request as the engine sees it. `emit(kind, payload)` is called from the engine's thread:
    ("prompt", [TokenOut] of the echoed prompt, once it is fed, with echo), ("token", TokenOut), ("done",
    {"finish_reason", "prompt_tokens", "completion_tokens"}) or ("error", ApiError)."""

    def __init__(self, prompt: np.ndarray, params, emit: Callable[[str, object], None], session_id: str | None = None,
                 grammar=None, echo: bool = False, choices: int = 1,
                 choice_emit: Callable[[int], Callable] | None = None):
        self.prompt = np.asarray(prompt, dtype=np.int64).reshape(-1)
        # n or best_of: the rows this request samples, each from a copy of the prompt's memory; choice_emit(i) is
        # the emit of choice i (this job is choice 0), and `kids` the other choices once forked
        self.choices, self.choice_emit, self.kids = int(choices), choice_emit, []
        self.forked = None  # over a Triton fleet: the prompt's parked state this choice resumes from
        self.params, self.emit, self.session_id = params, emit, session_id
        self.grammar = grammar  # a music grammar compiled for the vocabulary (music/grammar.py), or None
        self.echo = bool(echo)  # send the prompt back (scored with params.logprobs): echo.py's PromptEcho
        self.echoed = None  # that PromptEcho, once admitted, until the prompt is sent
        self.cancelled = False
        self.session: Session | None = None
        self.handle = None  # the row
        self.fed = 0  # prompt tokens fed
        self.pending: int | None = None  # a sampled token not fed yet
        self.log_probs = None  # next-token log-probs [n_token] after the last call
        self.parts = None  # lazy decoding: (hidden [d_model], head [H]) after the last call, in place of log_probs
        self.finishing = False  # only the last token is left to feed (sessions), nothing more to send
        self.completion = None  # the request's Completion, once admitted
        self.admitted = 0.0
        self.touched = False  # the memory has taken tokens of this request

    @property
    def prefilling(self) -> bool:
        return self.fed < self.prompt.size

    def followed_grammar(self):
        """What this request samples under: its session's piece going on (`Session.grammar_for`), else its grammar,
        started after the prompt."""
        return self.grammar if self.session is None else self.session.grammar_for(self.grammar)

    def choice(self, i: int) -> "Job":
        """Choice i of this request, sampled on its own seed stream: seed + i (docs/serving.md, n and best_of)."""
        params = self.params if self.params.seed is None else dataclasses.replace(self.params,
                                                                                 seed=self.params.seed + i)
        kid = Job(self.prompt, params, self.choice_emit(i), grammar=self.grammar)
        self.kids.append(kid)
        return kid


class EngineClosed(Exception):
    """Raised by `_enqueue` when the engine stopped taking work after the admission checks passed."""


class EngineCore(abc.ABC):
    """Requests (`submit`, `cancel`), sessions (`create_session`, `delete_session`, `park`, `restore`) and
    `start`/`stop`, as the HTTP app calls them from any thread."""

    def __init__(self, vocab, n_token: int, max_batch: int, max_sessions: int, session_ttl: float | None,
                 max_queue: int):
        self.vocab, self.n_token = vocab, int(n_token)
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.sessions = SessionStore(int(max_sessions), session_ttl, self._dropped)
        self.on_batch: Callable[[int], None] = lambda n: None  # rows per decode call, where the engine batches
        self.on_failure: Callable[[BaseException], None] = lambda e: None
        self.draining = False
        self.failure: BaseException | None = None  # what stopped the engine, if anything did
        self._lock = threading.Lock()
        self._queued = 0

    # -- what each engine says ----------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """The engine takes requests (started, and neither stopped nor failed)."""

    @property
    @abc.abstractmethod
    def running(self) -> int:
        """Requests running now."""

    @abc.abstractmethod
    def _enqueue(self, job: Job):
        """Hand an admitted job to the engine, under the lock; raise EngineClosed if it takes no more."""

    @abc.abstractmethod
    def _park_bytes(self, session: Session) -> bytes:
        """The parking session's memory as bytes (ApiError 400 if it has none yet)."""

    @abc.abstractmethod
    def _check_state(self, blob: bytes):
        """Parked bytes, checked before a session is made for them (ApiError 400); what `_load_state` takes."""

    @abc.abstractmethod
    def _load_state(self, session: Session, state):
        """Put a checked state into the `loading` session's memory (its handle set)."""

    @abc.abstractmethod
    def _copy_session(self, source: Session, fork: Session):
        """Give the `loading` session `fork` a copy of the forking session `source`'s memory and next distribution."""

    @abc.abstractmethod
    def _dropped(self, session: Session, why: str):
        """The store ended the session (any thread, under its lock): free its memory."""

    @abc.abstractmethod
    def _shut_down(self, timeout: float):
        """Finish or answer what runs and waits (at most `timeout` seconds), then end."""

    # -- requests -----------------------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    def start(self):
        pass

    def submit(self, job: Job):
        """Queue a request, or raise ApiError at once (503 stopped or draining, 429 queue full, 404/409 session,
        400 nothing to continue)."""
        job.params.check_vocabulary(self.n_token)
        # Under the lock: an engine that ends takes the lock to do so, so whatever was queued before is answered.
        with self._lock:
            if not self.alive:
                raise self._not_running()
            self._check_admission(job)
            self._queued += 1
            try:
                self._enqueue(job)
            except EngineClosed:
                self._queued -= 1
                if job.session is not None:
                    self.sessions.release(job.session)
                raise self._not_running() from None

    def _check_admission(self, job: Job):
        """The checks a request passes before it is queued, under the lock; on success `job.session` is the
        acquired session, if the request names one."""
        if self.draining:
            raise ApiError(503, "the server is shutting down and takes no new requests", type="server_error",
                           code="draining")
        if self._queued >= self.max_queue:
            raise ApiError(429, f"the server is busy: {self._queued} requests are waiting (--max-queue "
                                f"{self.max_queue}); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        if job.session_id is not None:
            job.session = self.sessions.acquire(job.session_id)
            if not job.prompt.size and not job.session.continuable:
                self.sessions.release(job.session)
                raise ApiError(400, f"session {job.session_id!r} has no text yet: send a prompt", param="prompt")
        elif not job.prompt.size:
            raise ApiError(400, "the prompt is empty (only a session can be continued without one)", param="prompt")

    def _dequeued(self):
        """A queued job left the queue (to run, or answered)."""
        with self._lock:
            self._queued -= 1

    def cancel(self, job: Job):
        """The client went away: the job (and its other choices) ends at the engine's next look at it."""
        for one in (job, *job.kids):
            one.cancelled = True

    def _not_running(self) -> ApiError:
        """The 503 a request gets from an engine that does not take requests."""
        if self.failure is not None:
            return ApiError(503, f"the engine stopped on an internal error ({type(self.failure).__name__}): this "
                                 "server takes no more requests", type="server_error", code="engine_failed")
        return ApiError(503, "the engine is not running", type="server_error", code="engine_stopped")

    def stop(self, timeout: float = 30.0):
        """Stop taking requests, let the running and waiting ones finish (at most `timeout` seconds), then end."""
        with self._lock:
            self.draining = True
        self._shut_down(timeout)

    def _notify_failure(self, error: BaseException):
        """Tell the owner (the server exits on it) that the engine stopped on `error`."""
        try:
            self.on_failure(error)
        except Exception:  # noqa: BLE001 - the engine has stopped either way
            logger.exception("on_failure failed")

    # -- sessions -----------------------------------------------------------------------------------------------
    def create_session(self, id_: str | None = None) -> Session:
        return self.sessions.create(id_)

    def delete_session(self, id_: str):
        self.sessions.remove(id_, f"was deleted; {GONE}")

    def park(self, id_: str) -> bytes:
        """The session's memory as bytes; then the session ends. It ends only once the bytes exist: if they cannot
        be made (or it has no memory yet: 400), it stays as it was. Blocks: call it from a worker thread."""
        session = self.sessions.begin_park(id_)
        parked = False
        try:
            blob = self._park_bytes(session)
            parked = True
            return blob
        finally:
            self.sessions.end_park(session, parked)

    def fork(self, id_: str, fork_id: str | None = None) -> Session:
        """A new session holding a copy of session `id_`'s memory and next distribution; the two are independent
        from then on. The new one counts against --max-sessions as any new session does (the same eviction, or
        429). The source must be idle (409 otherwise) and stays so. Blocks: call it from a worker thread."""
        source = self.sessions.begin_fork(id_)

        def fill(fork: Session):
            self._copy_session(source, fork)
            fork.grammar = copy.copy(source.grammar)  # a music grammar's piece goes on in each

        try:
            return self._new_session(fork_id, fill, "forked", tokens=source.tokens)
        finally:
            self.sessions.end_fork(source)

    def restore(self, id_: str | None, blob: bytes) -> Session:
        """A new session from parked bytes; refused (400) when they are not a state of this model. The session is
        `loading` (nothing may use it or take it away) until its memory holds the state. Blocks: call it from a
        worker thread."""
        state = self._check_state(blob)
        return self._new_session(id_, lambda session: self._load_state(session, state), "restored")

    def _new_session(self, id_: str | None, fill, done: str, tokens: int | None = None) -> Session:
        """A new session, `loading` (nothing may use it or take it away) until `fill(session)` has put its memory
        in; discarded if that fails."""
        session = self.sessions.create(id_, loading=True)
        try:
            fill(session)
        except BaseException:
            self.sessions.discard(session, f"could not be {done}; {GONE}")
            raise
        if tokens is not None:
            session.tokens = tokens
        self.sessions.loaded(session)
        return session
