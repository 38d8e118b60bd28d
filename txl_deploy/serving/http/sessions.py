"""Sessions: named memories that outlive a request, bounded in number (least recently used evicted) and idle time.

The store keeps only what a session is (its id, times, token count, the engine's handle on its memory) and the
rules; the engine owns the memory itself and is told to free it (`on_drop`). A session runs one request at a time
(`acquire` marks it busy; a second request gets 409). A session that is gone is remembered for a while with the
reason, so a request for it gets a 404 that says what happened (evicted, expired, deleted, parked) instead of a new,
empty memory. Thread-safe: HTTP handlers and the engine thread both call it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Callable

from txl_deploy.serving.http.protocol import ApiError, new_id

GONE = "its memory is gone (a request never starts an empty one): create a new session"
PARKED = "was parked: POST its state to /v1/sessions/ID/restore to continue it"
FORGOTTEN_KEPT = 4096  # ids of gone sessions remembered (with why they are gone) for the 404's message


class Session:
    __slots__ = ("id", "created", "used", "busy", "handle", "tokens", "last_log_probs")

    def __init__(self, id_: str, now: float):
        self.id, self.created, self.used, self.busy = id_, now, now, False
        self.handle = None  # the engine's: a row of the batched memory, or a Triton conversation
        self.tokens = 0  # tokens the memory has consumed
        self.last_log_probs = None  # next-token log-probs after the last request (continuing without a prompt)


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

    def _drop(self, session: Session, why: str, notify: bool = True):
        del self._live[session.id]
        self._gone[session.id] = why
        self._gone.move_to_end(session.id)
        while len(self._gone) > FORGOTTEN_KEPT:
            self._gone.popitem(last=False)
        if notify:
            self.on_drop(session, why)

    def create(self, id_: str | None = None) -> Session:
        with self._lock:
            self._expire()
            id_ = id_ or new_id("sess")
            if id_ in self._live:
                raise ApiError(409, f"session {id_!r} already exists", param="id", code="session_exists")
            while len(self._live) >= self.max_sessions:
                idle = next((s for s in self._live.values() if not s.busy), None)
                if idle is None:
                    raise ApiError(429, f"all {self.max_sessions} sessions are running a request: none can be "
                                        "evicted for a new one", type="rate_limit_error", code="sessions_full",
                                   headers={"Retry-After": "1"})
                self._drop(idle, f"was evicted: the server keeps at most {self.max_sessions} sessions "
                                 f"(--max-sessions) and this one was the least recently used; {GONE}")
            session = Session(id_, self.clock())
            self._live[id_] = session
            self._gone.pop(id_, None)
            return session

    def acquire(self, id_: str) -> Session:
        """The session, marked busy (one request at a time) and most recently used."""
        with self._lock:
            session = self._find(id_)
            if session.busy:
                raise ApiError(409, f"session {id_!r} is running another request; send one request at a time",
                               param="session_id", code="session_busy")
            session.busy = True
            session.used = self.clock()
            self._live.move_to_end(id_)
            return session

    def release(self, session: Session):
        with self._lock:
            session.busy = False
            session.used = self.clock()

    def get(self, id_: str) -> Session:
        with self._lock:
            return self._find(id_)

    def _find(self, id_: str) -> Session:
        """The live session (after expiring idle ones), or the 404/410 ApiError; under the lock."""
        self._expire()
        session = self._live.get(id_)
        if session is None:
            raise self._missing(id_)
        return session

    def remove(self, id_: str, why: str, notify: bool = True) -> Session:
        """Take the session out (deleted, parked); refused while it runs a request. notify=False: the caller frees
        the memory itself (parking reads it first)."""
        with self._lock:
            session = self._live.get(id_)
            if session is None:
                raise self._missing(id_)
            if session.busy:
                raise ApiError(409, f"session {id_!r} is running a request; try again when it is done",
                               param="session_id", code="session_busy")
            self._drop(session, why, notify)
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
        return {"id": session.id, "object": "session", "tokens": session.tokens, "busy": session.busy,
                "idle_seconds": round(now - session.used, 3), "age_seconds": round(now - session.created, 3),
                "expires_in_seconds": None if self.ttl is None else round(max(0.0, self.ttl - (now - session.used)), 3),
                "memory_bytes": bytes_per_session}

    def all_ids(self) -> list[str]:
        with self._lock:
            return list(self._live)
