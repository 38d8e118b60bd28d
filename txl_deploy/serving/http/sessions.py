"""Sessions: named memories that outlive a request, bounded in number (least recently used evicted) and idle time.

The store keeps only what a session is (its id, state, times, token count, the engine's handle on its memory) and
the rules; the engine owns the memory itself and is told to free it (`on_drop`). A session is in one state at a
time, and every call is one transition, made whole under the store's lock or refused with a 4xx:

    create -> idle;  restore -> loading -> idle (its row loaded) or gone (the restore failed)
    idle -> running (a request: `acquire`) -> idle (`release`)
    idle -> parking (`begin_park`) -> gone (the parked bytes exist: `end_park(parked=True)`) or idle (they could
            not be made: nothing was lost)
    idle -> forking (`begin_fork`: its memory is copied into a new `loading` session) -> idle (`end_fork`)
    idle -> gone (delete, eviction of the least recently used idle session, idle longer than the TTL)

Only an idle session can be taken away, so a session that is loading, running or parking keeps its memory until
that ends: a request or a delete meanwhile gets 409 (so does one on a session being forked). A session that is gone is remembered for a while with the
reason, so a request for it gets a 404 that says what happened (evicted, expired, deleted, parked) instead of a new,
empty memory. Thread-safe: HTTP handlers and the engine thread both call it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

import numpy as np

from txl_deploy.serving.http.protocol import ApiError, new_id

GONE = "its memory is gone (a request never starts an empty one): create a new session"
PARKED = "was parked: POST its state to /v1/sessions/ID/restore to continue it"
FORGOTTEN_KEPT = 4096  # ids of gone sessions remembered (with why they are gone) for the 404's message

IDLE, RUNNING, LOADING, PARKING, FORKING, ENDED = "idle", "running", "loading", "parking", "forking", "gone"
_DOING = {RUNNING: "is running a request", LOADING: "is being restored", PARKING: "is being parked",
          FORKING: "is being forked"}


class Session:
    __slots__ = ("id", "created", "used", "state", "handle", "tokens", "last_log_probs", "last_head", "grammar")

    def __init__(self, id_: str, now: float, state: str = IDLE):
        self.id, self.created, self.used, self.state = id_, now, now, state
        self.handle = None  # the engine's: a row of the batched memory, or a Triton conversation
        self.tokens = 0  # tokens the memory has consumed
        # What a request without a prompt continues from, after the last request: the full next-token distribution
        # (float32 [n_token], what a parked state holds), or over a lazy Triton fleet only the adaptive softmax's
        # head of it ([shortlist + clusters]; the conversation keeps it, its server the hidden vector for the tails).
        self.last_log_probs: np.ndarray | None = None
        self.last_head: np.ndarray | None = None
        # Where the last request left a music grammar (a GrammarState, music/grammar.py), so a request under the same
        # grammar goes on with the piece rather than starting one; None after a request without one, or cut short.
        self.grammar = None

    @property
    def continuable(self) -> bool:
        """A request may continue the session without a prompt: its memory ends at a known distribution."""
        return self.last_log_probs is not None or self.last_head is not None

    def forget_next(self):
        """The memory's next distribution is unknown (a request was cut short, or failed part way)."""
        self.last_log_probs = self.last_head = None
        self.grammar = None

    def grammar_for(self, compiled):
        """What a request under `compiled` (a CompiledGrammar, or None) samples under: the state the session's last
        request left, when it followed the same grammar (the piece goes on), else the grammar itself (it starts after
        this request's prompt)."""
        if compiled is not None and self.grammar is not None and self.grammar.compiled is compiled:
            return self.grammar
        return compiled

    @property
    def busy(self) -> bool:
        return self.state != IDLE


class SessionStore:
    def __init__(self, max_sessions: int, ttl: float | None, on_drop: Callable[[Session, str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.max_sessions, self.ttl, self.on_drop, self.clock = max_sessions, ttl, on_drop, clock
        self._live: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> why it is gone
        self._lock = threading.Lock()

    def __len__(self):
        return len(self._live)

    def _missing(self, id_: str) -> ApiError:
        why = self._gone.get(id_)
        if why is None:
            return ApiError(404, f"session {id_!r} does not exist: create it with POST /v1/sessions",
                            param="session_id", code="session_not_found")
        return ApiError(404, f"session {id_!r} {why}", param="session_id", code="session_gone")

    @staticmethod
    def _busy(session: Session, what: str) -> ApiError:
        return ApiError(409, f"session {session.id!r} {_DOING[session.state]}: {what}", param="session_id",
                        code="session_busy")

    def _drop(self, session: Session, why: str):
        del self._live[session.id]
        session.state = ENDED
        self._gone[session.id] = why
        self._gone.move_to_end(session.id)
        while len(self._gone) > FORGOTTEN_KEPT:
            self._gone.popitem(last=False)
        self.on_drop(session, why)

    def create(self, id_: str | None = None, loading: bool = False) -> Session:
        """A new idle session, or (loading=True, for a restore) one that nothing may use or take away until
        `loaded` or `discard`."""
        with self._lock:
            self._expire()
            id_ = id_ or new_id("sess")
            if id_ in self._live:
                raise ApiError(409, f"session {id_!r} already exists", param="id", code="session_exists")
            while len(self._live) >= self.max_sessions:
                idle = next((s for s in self._live.values() if not s.busy), None)
                if idle is None:
                    raise ApiError(429, f"all {self.max_sessions} sessions are busy (running a request, being "
                                        "restored, parked or forked): none can be evicted for a new one",
                                   type="rate_limit_error", code="sessions_full", headers={"Retry-After": "1"})
                self._drop(idle, f"was evicted: the server keeps at most {self.max_sessions} sessions "
                                 f"(--max-sessions) and this one was the least recently used; {GONE}")
            session = Session(id_, self.clock(), LOADING if loading else IDLE)
            self._live[id_] = session
            self._gone.pop(id_, None)
            return session

    def loaded(self, session: Session):
        """A restored session's memory is in place: it is idle (usable, and may be taken away) from now on."""
        with self._lock:
            if session.state == LOADING:
                session.state = IDLE
                session.used = self.clock()

    def discard(self, session: Session, why: str):
        """A restore that failed: the session it reserved is gone."""
        with self._lock:
            if self._live.get(session.id) is session:
                self._drop(session, why)

    def acquire(self, id_: str) -> Session:
        """The session, marked running (one request at a time) and most recently used."""
        with self._lock:
            session = self._find(id_)
            if session.busy:
                raise self._busy(session, "send one request at a time")
            session.state = RUNNING
            session.used = self.clock()
            self._live.move_to_end(id_)
            return session

    def release(self, session: Session):
        """The request on the session ended."""
        with self._lock:
            if session.state == RUNNING:
                session.state = IDLE
            session.used = self.clock()

    def begin_park(self, id_: str) -> Session:
        """The session, marked parking: it keeps its memory (and nothing may use or take it) until `end_park`."""
        return self._hold(id_, PARKING, "park")

    def end_park(self, session: Session, parked: bool):
        """parked: its bytes exist, the session ends (its memory is freed); else it is idle again, as it was."""
        with self._lock:
            if session.state != PARKING:
                return
            if parked:
                self._drop(session, PARKED)
            else:
                session.state = IDLE

    def begin_fork(self, id_: str) -> Session:
        """The session, marked forking: its memory stays as it is (nothing may use or take it) until `end_fork`."""
        return self._hold(id_, FORKING, "fork")

    def _hold(self, id_: str, state: str, verb: str) -> Session:
        """The idle session, now in `state` (parking or forking: nothing else may use or take it); 409 if busy."""
        with self._lock:
            session = self._find(id_)
            if session.busy:
                raise self._busy(session, f"{verb} it when that is done")
            session.state = state
            return session

    def end_fork(self, session: Session):
        """The fork is made (or failed): the session is idle again, as it was."""
        with self._lock:
            if session.state == FORKING:
                session.state = IDLE

    def get(self, id_: str) -> Session:
        with self._lock:
            return self._find(id_)

    def _find(self, id_: str) -> Session:
        """The live session (after expiring idle ones), or the 404 ApiError; under the lock."""
        self._expire()
        session = self._live.get(id_)
        if session is None:
            raise self._missing(id_)
        return session

    def remove(self, id_: str, why: str) -> Session:
        """Take an idle session away (deleted); refused (409) while it runs a request, loads or parks."""
        with self._lock:
            session = self._live.get(id_)
            if session is None:
                raise self._missing(id_)
            if session.busy:
                raise self._busy(session, "try again when that is done")
            self._drop(session, why)
            return session

    def expire(self):
        with self._lock:
            self._expire()

    def _expire(self):
        if self.ttl is None:
            return
        now = self.clock()
        for session in [s for s in self._live.values() if not s.busy and now - s.used > self.ttl]:
            self._drop(session, f"expired: it was idle for longer than {self.ttl:g} s (--session-ttl); {GONE}")

    def info(self, session: Session, bytes_per_session: int | None) -> dict:
        now = self.clock()
        return {"id": session.id, "object": "session", "state": session.state, "tokens": session.tokens,
                "busy": session.busy, "idle_seconds": round(now - session.used, 3),
                "age_seconds": round(now - session.created, 3),
                "expires_in_seconds": None if self.ttl is None else round(max(0.0, self.ttl - (now - session.used)), 3),
                "memory_bytes": bytes_per_session}

    def all_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def live(self) -> list[Session]:
        with self._lock:
            return list(self._live.values())
