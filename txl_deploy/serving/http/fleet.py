"""The same engine interface as the local scheduler, over a fleet of Triton servers (`txl-deploy serve --triton`).

Each request runs in a worker thread (at most `max_batch` at once, the rest queue) as a Triton conversation through
`TxlTritonClient`: the prompt is sent once (in pieces the servers accept), then one request per generated token;
the Triton servers keep the memory and batch the conversations of all frontends. Tokens are chosen here, by the
same `Completion` (sampler, stop strings) the local engine uses, from the log-probs the servers return.

A session is a conversation kept open between requests. Its Triton sequence id is derived from the session id,
so the client's rendezvous hashing always sends it to the same server (and every frontend with the same server
list would pick the same one); parking returns the Triton model's parked state (`Conversation.park`), restoring
resumes it on the server its id routes to. A session whose server was lost answers 404 saying so.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from txl_deploy.errors import InputError, TxlError
from txl_deploy.serving.http.completion import Completion
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.scheduler import Job, admit
from txl_deploy.serving.http.sessions import GONE, PARKED, Session, SessionStore
from txl_deploy.serving.triton.client import ServingError, TxlTritonClient, split_url
from txl_deploy.serving.triton.protocol import PARAM_PREFIX

logger = logging.getLogger(__name__)


def sequence_id(session_id: str) -> int:
    """A session's Triton sequence id: a non-zero 63-bit hash of its id (stable across frontends and restarts)."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8, person=b"txl-session").digest()
    return (int.from_bytes(digest, "big") >> 1) | 1


class FleetEngine:
    def __init__(self, urls, model: str = "txl", vocab=None, max_batch: int = 16, max_sessions: int = 64,
                 session_ttl: float | None = 3600.0, max_queue: int = 64, timeout: float = 60.0):
        """urls: the Triton servers' gRPC addresses (grpc://HOST:PORT)."""
        self.urls, self.model = list(urls), model
        http = [u for u in self.urls if split_url(u)[0] != "grpc"]
        if http:
            # tritonclient's HTTP client runs on gevent and cannot be used from another thread than the one that
            # made it; a session's requests run on whichever worker is free.
            raise InputError(f"--triton needs the servers' gRPC addresses (grpc://HOST:PORT, Triton's port 8001 "
                             f"by default), got {', '.join(http)}")
        # one client for every worker thread (tritonclient's gRPC client may be shared)
        self.client = TxlTritonClient(self.urls, model=model, vocab=vocab, timeout=timeout)
        if self.client.vocab is None:
            self.client.close()
            raise InputError(f"model {model!r} publishes no vocabulary: pass --vocab REPO/{model}/vocab.json")
        self.vocab, self.n_token = self.client.vocab, self.client.n_token or len(self.client.vocab)
        self.mem_len = int(self.client.params.get(PARAM_PREFIX + "mem_len", 0) or 0) or None
        self.bytes_per_session = None  # held on the Triton servers (their repository's README says how much)
        self.max_batch, self.max_queue = int(max_batch), int(max_queue)
        self.sessions = SessionStore(int(max_sessions), session_ttl, self._dropped)
        self.on_batch = lambda n: None  # Triton batches; nothing to report here
        self.draining = False
        self._lock = threading.Lock()
        self._queued = self._running = 0
        self._workers = ThreadPoolExecutor(self.max_batch, thread_name_prefix="txl-serve-fleet")
        self._closer = ThreadPoolExecutor(1, thread_name_prefix="txl-serve-close")
        self._idle = threading.Condition(self._lock)

    @classmethod
    def connect(cls, urls, **options) -> "FleetEngine":
        engine = cls(urls, **options)
        logger.info("serving through %d Triton server(s): %s (model %r); sessions' memories live on the servers "
                    "(the repository's README says how much each takes)", len(engine.urls), ", ".join(engine.urls),
                    engine.model)
        return engine

    @property
    def queue_depth(self) -> int:
        return self._queued

    @property
    def running(self) -> int:
        return self._running

    def start(self):
        pass

    def stop(self, timeout: float = 30.0):
        with self._lock:
            self.draining = True
            self._idle.wait_for(lambda: self._queued + self._running == 0, timeout)
        self._workers.shutdown(wait=False, cancel_futures=True)
        for id_ in self.sessions.all_ids():
            try:
                self.sessions.remove(id_, "ended when the server stopped")
            except ApiError:
                pass
        self._closer.shutdown(wait=True)
        self.client.close()

    # -- requests ---------------------------------------------------------------------------------------------
    def submit(self, job: Job):
        job.params.check_vocabulary(self.n_token)
        with self._lock:
            admit(job, self.sessions, self.draining, self._queued, self.max_queue)
            self._queued += 1
        self._workers.submit(self._run, job)

    def cancel(self, job: Job):
        job.cancelled = True

    def _conversation(self, session: Session | None):
        if session is None:
            return self.client.conversation()
        if session.handle is None:
            session.handle = self.client.conversation(sequence_id(session.id))
        return session.handle

    def _run(self, job: Job):
        with self._lock:
            self._queued -= 1
            self._running += 1
        conv, last = None, None  # last: the request's final event, sent once its session is released
        try:
            if job.cancelled:
                return
            conv = self._conversation(job.session)
            completion = Completion(job.params, self.vocab, self.n_token, context=job.prompt)
            log_probs = conv.feed(job.prompt) if job.prompt.size else job.session.last_log_probs
            fed = int(job.prompt.size)
            while completion.finish is None and not job.cancelled:
                out = completion.next(log_probs)
                job.emit("token", out)
                if completion.finish is None or job.session is not None:
                    log_probs = conv.feed([out.token])  # a session's memory takes the last token too
                    fed += 1
            if job.session is not None:
                job.session.tokens += fed
                job.session.last_log_probs = np.array(log_probs, dtype=np.float32)
            if not job.cancelled:
                last = ("done", {"finish_reason": completion.finish, "prompt_tokens": int(job.prompt.size),
                                 "completion_tokens": completion.generated})
        except ServingError as e:
            last = ("error", ApiError(502, f"the Triton fleet failed this request: {e}", type="server_error",
                                      code="upstream_error"))
            if job.session is not None:  # its memory is in an unknown state (or gone with its server)
                job.session.last_log_probs = None
        except TxlError as e:
            last = ("error", e if isinstance(e, ApiError) else ApiError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug must fail the request, not hang it
            logger.exception("a fleet request failed")
            last = ("error", ApiError(500, f"internal error: {e}", type="server_error"))
        finally:
            # The session is released before the client hears the end: a client that sends its next request on
            # the session as soon as this one answers must find it free, not busy.
            if job.session is not None:
                self.sessions.release(job.session)
            if last is not None:
                job.emit(*last)
            if job.session is None and conv is not None:
                self._close(conv)
            with self._lock:
                self._running -= 1
                self._idle.notify_all()

    @staticmethod
    def _close(conv):
        try:
            conv.close()
        except (ServingError, InputError):
            pass  # the server forgets it at its idle timeout

    # -- sessions -------------------------------------------------------------------------------------------
    def create_session(self, id_: str | None = None) -> Session:
        return self.sessions.create(id_)

    def delete_session(self, id_: str):
        self.sessions.remove(id_, f"was deleted; {GONE}")

    def _dropped(self, session: Session, why: str):
        if session.handle is not None:
            conv, session.handle = session.handle, None
            self._closer.submit(self._close, conv)

    def park(self, id_: str) -> bytes:
        """The session's memory as the Triton model's parked state (bytes); the session ends."""
        session = self.sessions.remove(id_, PARKED, notify=False)
        conv, session.handle = session.handle, None
        if conv is None or not conv.started:
            raise ApiError(400, f"session {id_!r} has no memory yet: nothing to park", param="session_id")
        try:
            return conv.park()
        except ServingError as e:
            raise ApiError(502, f"the Triton fleet could not park the session: {e}", type="server_error",
                           code="upstream_error") from None

    def restore(self, id_: str | None, blob: bytes) -> Session:
        session = self.sessions.create(id_)
        try:
            conv = self.client.resume(blob, sequence_id=sequence_id(session.id))
        except (ServingError, InputError) as e:
            self.sessions.remove(session.id, "could not be restored")
            raise ApiError(400, f"not a state of this model: {e}", code="invalid_state") from None
        session.handle = conv
        session.last_log_probs = conv.last_log_probs
        return session
