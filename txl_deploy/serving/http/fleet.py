"""The same engine interface as the local scheduler, over a fleet of Triton servers (`txl-deploy serve --triton`).

Each request runs in a worker thread (at most `max_batch` at once, the rest queue) as a Triton conversation through
`TxlTritonClient`: the prompt is sent once (in pieces the servers accept), then one request per generated token;
the Triton servers keep the memory and batch the conversations of all frontends. Tokens are chosen here, by the
same `Completion` (sampler, stop strings) the local engine uses, from the log-probs the servers return.

Lazy decoding (`lazy=True`, `txl-deploy serve --triton URLS --lazy`), for a model with an adaptive softmax whose
servers answer head and tail requests (the Python backend; `TxlTritonClient(lazy=True)`): each token fed asks for
the head of the next distribution only, and the request's sampler decides on it (`Sampler.start`), fetching in one
more request only the tail clusters its decision needs (`Choice.reveal`); `Completion.decided` then gives the
token and its log-probs. The tokens are the non-lazy path's (the same sampler, with the model's clusters, on the
same distribution), the log-probs the parts' numbers. A session then holds only the head of its next distribution
(`Session.last_head`; its conversation keeps it too, and the server the hidden vector its tails come from), so a
request that continues it without a prompt decides from there exactly as the request before would have gone on.
A prompt echoed with logprobs (echo.py) is fed asking for the full distribution at each of its positions
(`Conversation.feed_all`), lazily too; its first token is then chosen on the full distribution.

A session is a conversation kept open between requests. Its Triton sequence id is derived from the session id,
so the client's rendezvous hashing always sends it to the same server (and every frontend with the same server
list would pick the same one); parking returns the Triton model's parked state (`Conversation.park`), restoring
resumes it on the server its id routes to. A session whose server was lost answers 404 saying so.

Admission, the order of a park and a restore, and the 503 of a stopped engine are the shared core's (engine.py).
Sessions go through the same states as the local engine's (`sessions.py`): a restoring session is `loading` until
its conversation is resumed (nothing may use it or delete it meanwhile), a parking one keeps its conversation until
the parked bytes are in hand, and a new conversation under a session's sequence id waits until the one of an
earlier session of that name has been ended on its server (else that late end would end the new one).

A request's own failure is answered (502 for the fleet's, 500 for anything else). If the frontend's bookkeeping
itself fails, the engine stops as the local one does: `failure` is set, queued requests get 503, new ones too, and
`on_failure` is called.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from txl_deploy.errors import InputError, TxlError
from txl_deploy.serving.http.completion import Completion
from txl_deploy.serving.http.echo import PromptEcho, scoring_chunk
from txl_deploy.serving.http.engine import EngineClosed, EngineCore, Job
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.sessions import Session
from txl_deploy.serving.triton.client import TxlTritonClient
from txl_deploy.serving.triton.protocol import PARAM_PREFIX
from txl_deploy.serving.triton.servers import ServingError, new_sequence_id, split_url

logger = logging.getLogger(__name__)


def sequence_id(session_id: str) -> int:
    """A session's Triton sequence id: a non-zero 63-bit hash of its id (stable across frontends and restarts)."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8, person=b"txl-session").digest()
    return (int.from_bytes(digest, "big") >> 1) | 1


class FleetEngine(EngineCore):
    def __init__(self, urls, model: str = "txl", vocab=None, max_batch: int = 16, max_sessions: int = 64,
                 session_ttl: float | None = 3600.0, max_queue: int = 64, timeout: float = 60.0, lazy: bool = False):
        """urls: the Triton servers' gRPC addresses (grpc://HOST:PORT). lazy: decode from the head and only the
        tails each decision needs, where the model has an adaptive softmax (see the module's docstring)."""
        self.urls, self.model = list(urls), model
        http = [u for u in self.urls if split_url(u)[0] != "grpc"]
        if http:
            # tritonclient's HTTP client runs on gevent and cannot be used from another thread than the one that
            # made it; a session's requests run on whichever worker is free.
            raise InputError(f"--triton needs the servers' gRPC addresses (grpc://HOST:PORT, Triton's port 8001 "
                             f"by default), got {', '.join(http)}")
        # one client for every worker thread (tritonclient's gRPC client may be shared)
        self.client = TxlTritonClient(self.urls, model=model, vocab=vocab, timeout=timeout, lazy=lazy)
        if self.client.vocab is None:
            self.client.close()
            raise InputError(f"model {model!r} publishes no vocabulary: pass --vocab REPO/{model}/vocab.json")
        self.lazy = self.client.lazy
        if lazy and not self.lazy:
            logger.info("lazy decoding needs an adaptive softmax's head and tail clusters (a model that publishes "
                        "txl_deploy.cutoffs); model %r has none, so every step asks for the full distribution", model)
        super().__init__(self.client.vocab, self.client.n_token or len(self.client.vocab), max_batch, max_sessions,
                         session_ttl, max_queue)  # on_batch stays silent: Triton batches
        self.mem_len = int(self.client.params.get(PARAM_PREFIX + "mem_len", 0) or 0) or None
        self.bytes_per_session = None  # held on the Triton servers (their repository's README says how much)
        self._stopped = False
        self._running = 0
        self._workers = ThreadPoolExecutor(self.max_batch, thread_name_prefix="txl-serve-fleet")
        self._closer = ThreadPoolExecutor(1, thread_name_prefix="txl-serve-close")
        self._closing: dict[int, Future] = {}  # sequence id -> the close of a gone session's conversation
        self._idle = threading.Condition(self._lock)

    @classmethod
    def connect(cls, urls, **options) -> "FleetEngine":
        engine = cls(urls, **options)
        logger.info("serving through %d Triton server(s): %s (model %r); sessions' memories live on the servers "
                    "(the repository's README says how much each takes)", len(engine.urls), ", ".join(engine.urls),
                    engine.model)
        if engine.lazy:
            logger.info("decoding lazily: each step asks the servers for the adaptive softmax's head, and for a tail "
                        "only when the request's decision needs it")
        return engine

    @property
    def running(self) -> int:
        return self._running

    @property
    def alive(self) -> bool:
        return self.failure is None and not self._stopped

    def _shut_down(self, timeout: float):
        with self._lock:
            self._idle.wait_for(lambda: self._queued + self._running == 0, timeout)
            self._stopped = True
        self._workers.shutdown(wait=False, cancel_futures=True)
        for id_ in self.sessions.all_ids():
            try:
                self.sessions.remove(id_, "ended when the server stopped")
            except ApiError:
                pass
        self._closer.shutdown(wait=True)
        self.client.close()

    # -- requests ---------------------------------------------------------------------------------------------
    def _enqueue(self, job: Job):
        try:
            self._workers.submit(self._run, job)
        except RuntimeError:  # the workers were shut down meanwhile (the server stops)
            raise EngineClosed() from None

    def _conversation(self, session: Session | None):
        if session is None:
            return self.client.conversation()
        if session.handle is None:
            seq = sequence_id(session.id)
            self._settle(seq)
            session.handle = self.client.conversation(seq)
        return session.handle

    def _run(self, job: Job):
        try:
            if job.choices > 1:
                self._serve_choices(job)
            else:
                self._serve(job)
        except BaseException as e:  # noqa: BLE001 - the bookkeeping failed: the sessions can no longer be trusted
            self._fail_engine(e)
            try:  # the client may not have heard the end (a second error after it is never read)
                job.emit("error", ApiError(500, f"the engine stopped on an internal error ({type(e).__name__}: {e})",
                                           type="server_error", code="internal_error"))
            except Exception:  # noqa: BLE001 - its event loop is gone: nobody is waiting
                logger.exception("a request's event could not be delivered")

    def _fail_engine(self, error: BaseException):
        with self._lock:
            if self.failure is not None:
                return
            self.failure = error
        logger.error("the engine stopped", exc_info=error)
        self._notify_failure(error)

    def _serve(self, job: Job):
        with self._lock:
            self._queued -= 1
            self._running += 1
        conv, last = None, None  # last: the request's final event, sent once its session is released
        try:
            if self.failure is not None:  # queued when the engine stopped: answered, never run
                last = ("error", self._not_running())
                return
            if job.cancelled:
                return
            conv = self._conversation(job.session) if job.forked is None else self._resumed(job.forked)
            completion = Completion(job.params, self.vocab, self.n_token, context=job.prompt,
                                    clusters=self.client.clusters, grammar=job.followed_grammar())
            # lazily the head of each distribution (the conversation keeps it, the server its hidden vector), else
            # the full log-probs
            feed = conv.feed_head if self.lazy else conv.feed
            full = not self.lazy  # log_probs is a full distribution (else a head)
            scored = job.echo and job.params.logprobs is not None and job.prompt.size
            echoed = PromptEcho.of(job, self.vocab, self._session_log_probs(job, conv) if scored else None)
            if job.forked is not None:  # a choice: the prompt was read once, into the state it resumed
                log_probs = conv.latest_head() if self.lazy else conv.last_log_probs
            elif echoed is not None and echoed.scoring:  # every position's full distribution, in bounded pieces
                step = scoring_chunk(self.n_token, job.prompt.size)
                for lo in range(0, job.prompt.size, step):
                    echoed.chunk(conv.feed_all(job.prompt[lo:lo + step]))
                log_probs, full = echoed.before, True
            elif job.prompt.size:
                log_probs = feed(job.prompt)
            else:  # a session continued: its conversation's latest distribution
                log_probs = conv.latest_head() if self.lazy else job.session.last_log_probs
            if echoed is not None:
                job.emit("prompt", echoed.outs())
            fed = int(job.prompt.size)
            while completion.finish is None and not job.cancelled:
                out = completion.next(log_probs) if full else self._decide(conv, completion, log_probs)
                job.emit("token", out)
                if completion.finish is None or job.session is not None:
                    log_probs, full = feed([out.token]), not self.lazy  # a session's memory takes the last token too
                    fed += 1
            if job.session is not None:
                job.session.tokens += fed
                job.session.forget_next()
                if full:
                    job.session.last_log_probs = np.array(log_probs, dtype=np.float32)
                else:  # what a next request continues from is the conversation's (`latest_head`)
                    job.session.last_head = np.array(log_probs, dtype=np.float32)
                job.session.grammar = completion.sampler.constraint
            if not job.cancelled:
                last = ("done", {"finish_reason": completion.finish, "prompt_tokens": int(job.prompt.size),
                                 "completion_tokens": completion.generated})
        except ServingError as e:
            last = ("error", ApiError(502, f"the Triton fleet failed this request: {e}", type="server_error",
                                      code="upstream_error"))
            if job.session is not None:  # its memory is in an unknown state (or gone with its server)
                job.session.forget_next()
        except TxlError as e:
            last = ("error", e if isinstance(e, ApiError) else ApiError(400, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug must fail the request, not hang it
            logger.exception("a fleet request failed")
            last = ("error", ApiError(500, f"internal error: {e}", type="server_error"))
        finally:
            try:
                # The session is released before the client hears the end: a client that sends its next request on
                # the session as soon as this one answers must find it free, not busy.
                if job.session is not None:
                    self.sessions.release(job.session)
                if last is not None:
                    job.emit(*last)
                if job.session is None and conv is not None:
                    self._close(conv)
            finally:
                with self._lock:
                    self._running -= 1
                    self._idle.notify_all()

    def _session_log_probs(self, job: Job, conv) -> np.ndarray | None:
        """The full next-token distribution of the job's session, which its prompt's first token is scored on:
        kept, or lazily composed from its head and every tail the conversation's server gives (None: none)."""
        session = job.session
        if session is None or session.last_log_probs is not None or session.last_head is None:
            return None if session is None else session.last_log_probs
        clusters = self.client.clusters
        return clusters.compose(session.last_head, conv.tails(range(1, clusters.n_clusters + 1)))

    def _serve_choices(self, job: Job):
        """n or best_of: the prompt read once in a conversation whose state is saved, then each choice resumed from
        that state in a conversation of its own and generated, one after another in this worker."""
        conv, state = self.client.conversation(), None
        with self._lock:  # every choice counts as queued until it runs: the engine is not idle in between
            self._queued += job.choices - 1
        try:
            if not job.cancelled and self.failure is None:
                (conv.feed_head if self.lazy else conv.feed)(job.prompt)
                state = conv.save()
        except Exception as e:  # noqa: BLE001 - answered as _serve answers a request's own failure
            if isinstance(e, ServingError):
                error = ApiError(502, f"the Triton fleet failed this request: {e}", type="server_error",
                                 code="upstream_error")
            elif isinstance(e, TxlError):
                error = e if isinstance(e, ApiError) else ApiError(400, str(e))
            else:
                logger.exception("a fleet request failed")
                error = ApiError(500, f"internal error: {e}", type="server_error")
            job.emit("error", error)
            with self._lock:
                self._queued -= job.choices
                self._idle.notify_all()
            return
        finally:
            self._close(conv)
        for i in range(job.choices):
            choice = job if i == 0 else job.choice(i)
            choice.forked, choice.cancelled = state, job.cancelled
            self._serve(choice)  # counts the choice out of the queue

    def _resumed(self, state: bytes):
        """A new conversation (its own sequence id) resumed from a saved state: a choice's copy of the prompt."""
        return self.client.resume(state, sequence_id=new_sequence_id())

    @staticmethod
    def _decide(conv, completion: Completion, head):
        """The next token from the head, fetching (in one request per round) only the tails the decision needs."""
        choice = completion.sampler.start(head)
        while choice.needs:
            needs = choice.needs
            for i, tail in zip(needs, conv.tails(needs)):
                choice.reveal(i, tail)
        return completion.decided(choice)

    @staticmethod
    def _close(conv):
        try:
            conv.close()
        except (ServingError, InputError):
            pass  # the server forgets it at its idle timeout

    # -- sessions: conversations on the servers ---------------------------------------------------------------
    def _dropped(self, session: Session, why: str):
        # under the store's lock: the conversation is ended by the closer thread, and remembered until it is
        if session.handle is not None:
            conv, session.handle = session.handle, None
            try:
                future = self._closer.submit(self._close, conv)
            except RuntimeError:  # stopped: the servers forget it at their idle timeout
                return
            self._closing[conv.id] = future
            future.add_done_callback(lambda f, seq=conv.id: self._closing.pop(seq, None)
                                     if self._closing.get(seq) is f else None)

    def _settle(self, seq: int):
        """Wait until an earlier conversation with this sequence id has been ended on its server."""
        future = self._closing.get(seq)
        if future is not None:
            future.result()

    def _copy_session(self, source: Session, fork: Session):
        """The source's conversation saved (it goes on) and resumed under the fork's sequence id, on the server
        that id routes to."""
        conv = source.handle
        if conv is None or not conv.started:  # nothing fed yet: the fork is as empty
            return
        try:
            state = conv.save()
        except ServingError as e:
            raise ApiError(502, f"the Triton fleet could not fork the session: {e}", type="server_error",
                           code="upstream_error") from None
        self._load_state(fork, state)

    def _park_bytes(self, session: Session) -> bytes:
        """The Triton model's parked state of the session's conversation. A session with nothing to park (400) or
        whose park failed (502) stays as it was."""
        conv = session.handle
        if conv is None or not conv.started:
            raise ApiError(400, f"session {session.id!r} has no memory yet: nothing to park (the session is kept)",
                           param="session_id")
        try:
            blob = conv.park()
        except ServingError as e:
            raise ApiError(502, f"the Triton fleet could not park the session: {e}", type="server_error",
                           code="upstream_error") from None
        session.handle = None  # ended on its server by the park itself
        return blob

    def _check_state(self, blob: bytes) -> bytes:
        return blob  # read by the server it is resumed on, as the untrusted input it is

    def _load_state(self, session: Session, blob: bytes):
        """Resume the conversation on the server the session's id routes to."""
        seq = sequence_id(session.id)
        self._settle(seq)
        try:
            conv = self.client.resume(blob, sequence_id=seq)
        except (ServingError, InputError) as e:
            raise ApiError(400, f"not a state of this model: {e}", code="invalid_state") from None
        session.handle = conv
        session.last_log_probs = conv.last_log_probs  # the full distribution a parked state holds
