"""Stream generation from a Triton server that serves a txl-deploy model (any backend `triton-repo` writes).

One conversation = one Triton sequence id: the first request carries `sequence_start`, the last `sequence_end`, and
the server keeps the conversation's memory in between, so each request sends only new tokens.

>>> client = TxlTritonClient("http://localhost:8000")          # or grpc://localhost:8001
>>> with client.conversation() as conv:
...     for text in conv.generate_text("the history of", max_new_tokens=20):
...         print(text, end="", flush=True)

Several servers: `TxlTritonClient(["grpc://node-a:8001", "grpc://node-b:8001", ...])` routes each conversation to
one server by rendezvous (highest-random-weight) hashing of its sequence id, so every client that knows the same
server list sends a conversation to the same server without talking to the others, and removing a server moves
only the conversations that were on it. A conversation can be parked (`Conversation.park()` -> bytes: its memory in
`TxlRuntime.save_state`'s format) and resumed on any server of the same model (`TxlTritonClient.resume(state)`);
`drain(url)` moves this client's conversations off a server before it is taken down. A server that cannot be
reached takes its conversations' memories with it: their next request raises a ServingError naming that server;
conversations on the other servers carry on, and new ones avoid it.

Needs `tritonclient[http]` or `tritonclient[grpc]`; numpy only otherwise (no torch). One client may be shared by
threads over gRPC (the HTTP client's connection is not thread-safe: give each thread its own client).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from typing import Iterator

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError, TxlError
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, generation_params, unk_id
from txl_deploy.runtimes.saved_state import read_state_metadata
from txl_deploy.serving.triton.protocol import (
    CUTOFFS_PARAM,
    HEAD_OUTPUT,
    PARAM_PREFIX,
    RESUME_INPUT,
    SAVED_OUTPUT,
    TAIL_INPUT,
    TAIL_OUTPUT,
    UNKNOWN_SEQUENCE,
    UNKNOWN_TO_MODEL,
)
from txl_deploy.vocab import CONTINUING, Vocab

GENERATE_DEFAULTS = dict(max_new_tokens=50, temperature=0.0, top_k=None, top_p=None, seed=None, stop=None)
LOST_RETRY_S = 30.0  # a server that could not be reached gets no new conversations for this long (if others can)


class ServingError(TxlError):
    """The server could not be reached, or refused a request."""


def split_url(url: str) -> tuple[str, str]:
    """'grpc://host:port' -> ('grpc', 'host:port'); a bare 'host:port' or http(s):// is HTTP."""
    url = url.strip()
    for scheme in ("grpc", "http"):
        if url.startswith(scheme + "://"):
            return scheme, url[len(scheme) + 3:].rstrip("/")
    if url.startswith("https://"):
        raise ServingError(f"{url}: https is not supported by this client; use http:// or grpc://")
    if "://" in url:
        raise ServingError(f"{url}: unknown scheme; use http://HOST:PORT or grpc://HOST:PORT")
    return "http", url.rstrip("/")


def new_sequence_id() -> int:
    """A random non-zero 63-bit id (Triton reserves 0 for 'no sequence'); collisions between clients are
    astronomically unlikely, so no coordination between load-balanced clients is needed."""
    return secrets.randbits(63) | 1


def rendezvous_order(key, urls) -> list[str]:
    """`urls` by rendezvous (highest-random-weight) score for `key`, best first. The score is a keyed hash of
    (server, key), so the order of a key's servers does not depend on which other servers exist: removing one
    moves only the keys whose best server it was, and each key's next server is its second best."""
    def score(url):
        digest = hashlib.blake2b(f"{url}\n{key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return sorted(urls, key=score, reverse=True)


class _Server:
    """One Triton server: its tritonclient connection and what the client knows about its health."""

    def __init__(self, url: str, model: str, timeout: float):
        self.url, self.timeout = url, timeout
        self.protocol, address = split_url(url)
        try:
            if self.protocol == "grpc":
                import tritonclient.grpc as tc  # optional (the triton extra)
            else:
                import tritonclient.http as tc  # optional (the triton extra)
        except ImportError as e:
            raise ServingError(f"the Triton client is not installed: pip install 'tritonclient[all]' ({e})") from None
        self.tc = tc
        try:
            if self.protocol == "grpc":
                self.client = tc.InferenceServerClient(address)
            else:
                self.client = tc.InferenceServerClient(address, connection_timeout=timeout, network_timeout=timeout)
        except Exception as e:  # bad address syntax
            raise ServingError(f"cannot connect to {url}: {_first_line(e)}") from None
        self.draining = False
        self.lost_at = None  # monotonic time of the last failed contact
        self.lost_reason = None

    def close(self):
        try:
            self.client.close()
        except Exception:
            pass


class TxlTritonClient:
    def __init__(self, url, model: str = "txl", vocab=None, timeout: float = 60.0, lazy: bool = False):
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ServingError("no server URL given")
        if len(set(urls)) != len(urls):
            raise ServingError(f"a server URL is listed twice: {urls}")
        self.model, self.timeout = model, timeout
        self.servers = {u: _Server(u, model, timeout) for u in urls}
        self._where = {}  # sequence id -> _Server, for this client's live conversations
        self._conversations = {}  # sequence id -> Conversation (live ones)
        self._lock = threading.Lock()
        first = self.servers[urls[0]]
        # the first server's connection, as before several servers were supported (benchmarks read statistics)
        self.url, self.protocol, self._tc, self._client = first.url, first.protocol, first.tc, first.client
        params, errors = None, []
        for server in self.servers.values():
            try:
                theirs = self._model_params(server)
            except ServingError as e:
                if len(self.servers) == 1:
                    raise
                self._mark_lost(server, str(e))
                errors.append(str(e))
                continue
            if params is None:
                params, params_from = theirs, server.url
            elif theirs != params:
                raise ServingError(f"{server.url} serves another model {model!r} than {params_from} (its "
                                   "parameters differ): every server of one client must serve the same model")
        if params is None:
            raise ServingError("no server could be reached: " + "; ".join(errors))
        self.params = params
        self.max_segment = int(self.params.get(PARAM_PREFIX + "max_segment", 0) or 0) or None
        self.n_token = int(self.params.get(PARAM_PREFIX + "n_token", 0) or 0) or None
        if vocab is not None:
            self.vocab = vocab if isinstance(vocab, Vocab) else Vocab.read(vocab)
        elif PARAM_PREFIX + "vocab" in self.params:
            self.vocab = Vocab.from_dict(json.loads(self.params[PARAM_PREFIX + "vocab"]))
        else:
            self.vocab = None
        # Lazy decoding (protocol.HEAD_OUTPUT / TAIL_INPUT): generate() fetches each step's head and only the tails
        # its sampler asks for, where the model has an adaptive softmax and serves them (the python backend).
        cutoffs = json.loads(self.params.get(CUTOFFS_PARAM) or "[]")
        self.clusters = Clusters.from_cutoffs(cutoffs, self.n_token) if self.n_token else None
        self.lazy = bool(lazy) and self.clusters is not None

    @property
    def urls(self) -> list[str]:
        return list(self.servers)

    # -- routing ---------------------------------------------------------------------------------------------------
    def route(self, sequence_id: int) -> str:
        """The server a new conversation with this id goes to: the best by rendezvous hashing among servers that
        are not draining and have not failed recently (any not draining if every one has failed recently)."""
        now = time.monotonic()
        open_ = [u for u, s in self.servers.items() if not s.draining]
        if not open_:
            raise ServingError("every server is draining: no server can take a conversation")
        healthy = [u for u in open_ if self.servers[u].lost_at is None or now - self.servers[u].lost_at > LOST_RETRY_S]
        return rendezvous_order(int(sequence_id), healthy or open_)[0]

    def server_of(self, sequence_id: int) -> str | None:
        """The server holding this client's live conversation `sequence_id` (None if it has not started)."""
        server = self._where.get(int(sequence_id))
        return None if server is None else server.url

    def _mark_lost(self, server: _Server, reason: str):
        server.lost_at, server.lost_reason = time.monotonic(), reason

    def drain(self, url: str) -> int:
        """Take a server out of rotation (planned): new conversations avoid it, and each of this client's
        conversations on it is parked there and resumed on its next server by rendezvous hashing. Returns how
        many moved. `undrain(url)` puts the server back for new conversations."""
        if url not in self.servers:
            raise InputError(f"{url} is not one of this client's servers ({', '.join(self.servers)})")
        self.servers[url].draining = True
        moved = 0
        for conv in list(self._conversations.values()):
            with conv._lock:
                if conv.server is not None and conv.server.url == url and not conv.ended:
                    conv._move(self.route(conv.id))
                    moved += 1
        return moved

    def undrain(self, url: str):
        self.servers[url].draining = False

    # -- plumbing --------------------------------------------------------------------------------------------------
    def _call(self, server: _Server, fn, *args, conversation=None, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # tritonclient raises its own exception, socket errors, gevent and grpc errors
            raise self._translate(server, e, kwargs.get("sequence_id"), conversation) from None
        server.lost_at = server.lost_reason = None
        return out

    def _translate(self, server: _Server, e: Exception, sequence_id, conversation=None) -> ServingError:
        message = _first_line(e)
        if UNKNOWN_SEQUENCE in message or UNKNOWN_TO_MODEL in message:
            return ServingError(f"the server at {server.url} does not know conversation {sequence_id} (it ended, "
                                "idled out, or the server restarted since it began): start a new conversation")
        status = e.status() if callable(getattr(e, "status", None)) else None  # grpc: "StatusCode.UNAVAILABLE"
        unreachable = isinstance(e, (ConnectionError, OSError, TimeoutError)) or "UNAVAILABLE" in str(status) or \
            any(s in message for s in ("Connection refused", "failed to connect", "connection reset",
                                       "Socket closed", "Broken pipe", "timed out", "Deadline Exceeded"))
        if unreachable:
            self._mark_lost(server, message)
            if conversation is not None and conversation.started:
                return ServingError(f"cannot reach Triton at {server.url} ({message}): conversation {sequence_id} "
                                    "lived on that server, and its memory is lost unless the server comes back "
                                    "with it: start a new conversation")
            return ServingError(f"cannot reach Triton at {server.url} ({message})")
        return ServingError(f"Triton at {server.url} refused the request: {message}")

    def _model_params(self, server: _Server) -> dict:
        if server.protocol == "grpc":
            config = self._call(server, server.client.get_model_config, self.model, as_json=True,
                                client_timeout=self.timeout).get("config", {})
        else:
            config = self._call(server, server.client.get_model_config, self.model)
        return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}

    def _server_for(self, sequence_id: int) -> _Server:
        return self._where.get(int(sequence_id)) or self.servers[self.route(sequence_id)]

    def _request(self, server: _Server, sequence_id: int, tokens, out_positions, start=False, end=False,
                 resume_state=None, want_state=False, conversation=None, output=io_spec.LOG_PROBS, tails=None):
        tc = server.tc
        tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(1, -1))
        positions = np.ascontiguousarray(np.asarray(out_positions, dtype=np.int64).reshape(1, -1))
        arrays = [(io_spec.TOKENS, tokens, "INT64"), (io_spec.OUT_POSITIONS, positions, "INT64")]
        if resume_state is not None:
            blob = np.frombuffer(bytes(resume_state), dtype=np.uint8).reshape(1, -1)
            arrays.append((RESUME_INPUT, blob, "UINT8"))
        if tails is not None:
            arrays.append((TAIL_INPUT, np.asarray(tails, dtype=np.int64).reshape(1, -1), "INT64"))
        inputs = []
        for name, array, dtype in arrays:
            inp = tc.InferInput(name, list(array.shape), dtype)
            inp.set_data_from_numpy(array)
            inputs.append(inp)
        outputs = [tc.InferRequestedOutput(output)]
        if want_state:
            outputs.append(tc.InferRequestedOutput(SAVED_OUTPUT))
        extra = {"client_timeout": self.timeout} if server.protocol == "grpc" else {}
        return self._call(server, server.client.infer, self.model, inputs, outputs=outputs,
                          sequence_id=int(sequence_id), sequence_start=bool(start), sequence_end=bool(end),
                          conversation=conversation, **extra)

    def infer(self, sequence_id: int, tokens, out_positions, start: bool = False, end: bool = False) -> np.ndarray:
        """One request of a conversation: tokens [Q] -> log_probs [P, V] at out_positions [P]. Goes to the server
        that holds the conversation (or the one it is routed to)."""
        result = self._request(self._server_for(sequence_id), sequence_id, tokens, out_positions, start, end)
        return result.as_numpy(io_spec.LOG_PROBS)[0]

    def conversation(self, sequence_id: int | None = None) -> "Conversation":
        return Conversation(self, sequence_id)

    def resume(self, state, sequence_id: int | None = None, url: str | None = None) -> "Conversation":
        """Start a conversation from a parked one's state (`Conversation.park()`), on `url` or the server its id
        routes to. The id defaults to the parked conversation's. Refused (ServingError) if the state belongs to
        another model."""
        state = bytes(state)
        if url is not None and url not in self.servers:
            raise InputError(f"{url} is not one of this client's servers ({', '.join(self.servers)})")
        if sequence_id is None:
            sequence_id = parked_info(state)["sequence_id"]
        conv = Conversation(self, sequence_id)
        with conv._lock:
            conv._resume(state, self.servers[url] if url else self.servers[self.route(conv.id)])
        return conv

    def encode(self, text: str) -> np.ndarray:
        if self.vocab is None:
            raise InputError(f"model {self.model!r} publishes no vocabulary: pass --vocab <repo>/{self.model}/vocab.json")
        return self.vocab.encode(text)

    def generate(self, prompt, max_new_tokens: int = 50, **sampling) -> Iterator[int]:
        """A whole conversation: prompt in, new tokens out one at a time, ended (slot freed) afterwards."""
        with self.conversation() as conv:
            yield from conv.generate(prompt, max_new_tokens=max_new_tokens, **sampling)

    def generate_text(self, prompt, max_new_tokens: int = 50, **sampling) -> Iterator[str]:
        """`generate`, as text that continues `prompt`, decoded incrementally (see `Conversation.generate_text`)."""
        with self.conversation() as conv:
            yield from conv.generate_text(prompt, max_new_tokens=max_new_tokens, **sampling)

    def close(self):
        for server in self.servers.values():
            server.close()


def parked_info(state: bytes) -> dict:
    """What a parked conversation's bytes say about it: sequence_id (or None), fingerprint, format_version."""
    try:
        meta = read_state_metadata(bytes(state))  # the small metadata members only, each bounded
    except InputError as e:
        raise InputError(f"not a parked conversation state ({_first_line(e)})") from None
    out = {"fingerprint": meta.get("__fingerprint__"), "format_version": meta.get("__format_version__"),
           "sequence_id": meta.get("__sequence_id__")}
    if out["fingerprint"] is None:
        raise InputError("not a parked conversation state (no fingerprint)")
    out["sequence_id"] = None if out["sequence_id"] is None else int(out["sequence_id"])
    return out


class Conversation:
    """One sequence on one server. Tokens are sent once; the server's memory carries the rest."""

    def __init__(self, client: TxlTritonClient, sequence_id: int | None = None):
        self.client = client
        self.id = int(sequence_id) if sequence_id is not None else new_sequence_id()
        if self.id <= 0:
            raise InputError("sequence ids must be positive integers (Triton reserves 0)")
        self.started = False
        self.ended = False
        self.server = None  # the _Server holding the memory, fixed at the first request
        self.pending = None  # a generated token the server has not been fed yet
        self.last_log_probs = None
        self.last_head = None  # lazy decoding: the head of the latest distribution (the full one is not fetched)
        self.received = 0  # log-prob values received, full, head or tail (what lazy decoding saves)
        self._lock = threading.RLock()  # a drain may move the conversation while another thread feeds it

    @property
    def url(self) -> str | None:
        """The server holding this conversation's memory."""
        return None if self.server is None else self.server.url

    def _register(self, server):
        self.server, self.started = server, True
        with self.client._lock:
            self.client._where[self.id] = server
            self.client._conversations[self.id] = self

    def _unregister(self):
        with self.client._lock:
            if self.client._conversations.get(self.id) is self:
                del self.client._conversations[self.id]
                self.client._where.pop(self.id, None)

    def feed(self, ids) -> np.ndarray:
        """Send token ids (split into pieces the server accepts); returns the next-token log-probs [V]."""
        return self._feed(ids, head=False)

    def feed_head(self, ids) -> np.ndarray:
        """Lazy decoding: send token ids as feed() does, receiving only the head [shortlist + n] of the next-token
        distribution (`last_head`); `tails(clusters)` then fetches the tail clusters a decision needs."""
        return self._feed(ids, head=True)

    def latest_head(self) -> np.ndarray | None:
        """The head of the latest next-token distribution: what a head-only feed received, or the head of the full
        log-probs a feed or a resume received (their tails are then sliced from those on the server); None before
        any."""
        with self._lock:
            if self.pending is None and self.last_head is None and self.last_log_probs is not None \
                    and self.client.clusters is not None:
                self.last_head = self.client.clusters.head_from_full(self.last_log_probs)
            return None if self.pending is not None else self.last_head

    def tails(self, clusters) -> list[np.ndarray]:
        """The log-probs of these tail clusters' tokens (numbered 1..n) in the latest distribution, one array per
        cluster in the order asked; the server's memory does not move."""
        return self._tails(clusters)

    def _feed(self, ids, head: bool) -> np.ndarray:
        """feed(); with head=True the server returns only the head of each distribution (`last_head`)."""
        output = HEAD_OUTPUT if head else io_spec.LOG_PROBS
        with self._lock:
            if self.ended:
                raise InputError(f"conversation {self.id} has ended")
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            if self.pending is not None:
                ids = np.concatenate([[self.pending], ids])
                self.pending = None
            if ids.size == 0:
                raise InputError("nothing to send: the prompt is empty")
            step = self.client.max_segment or ids.size
            server = self.server or self.client.servers[self.client.route(self.id)]
            for lo in range(0, ids.size, step):
                piece = ids[lo:lo + step]
                result = self.client._request(server, self.id, piece, [piece.size - 1], start=not self.started,
                                              conversation=self, output=output)
                last = result.as_numpy(output)[0][0]
                self.received += last.size
                self.last_log_probs, self.last_head = (None, last) if head else (last, None)
                if not self.started:
                    self._register(server)
            return last

    def _tails(self, clusters) -> list[np.ndarray]:
        """The log-probs of these tail clusters' tokens in the latest distribution, in one request that feeds
        nothing (the server's memory does not move)."""
        with self._lock:
            result = self.client._request(self.server, self.id, np.zeros(0, np.int64), np.zeros(0, np.int64),
                                          conversation=self, output=TAIL_OUTPUT, tails=list(clusters))
            flat = result.as_numpy(TAIL_OUTPUT).reshape(-1)
            self.received += flat.size
            sizes = [hi - lo for lo, hi in (self.client.clusters.bounds[i - 1] for i in clusters)]
            if flat.size != sum(sizes):
                raise ServingError(f"the server sent {flat.size} tail log-probs for clusters {list(clusters)}, "
                                   f"which hold {sum(sizes)} tokens")
            return np.split(flat, np.cumsum(sizes)[:-1])

    def generate(self, prompt=None, max_new_tokens: int = 50, temperature: float = 0.0, top_k=None, top_p=None,
                 seed=None, stop=None, *, params: SamplingParams | None = None, **controls) -> Iterator[int]:
        """Yield new token ids as they are produced (temperature 0: greedy), continuing this conversation. The
        sampling parameters are `TxlRuntime.generate`'s (the same sampler, runtimes/sampling/): the classic ones,
        the others by name, or one `params=SamplingParams(...)`; the stop token is yielded, then generation ends."""
        given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     stop=stop)
        params = generation_params("Conversation.generate()", params, given, GENERATE_DEFAULTS, controls)
        if self.client.n_token is not None:
            params.check_vocabulary(self.client.n_token)
        unk_id(params, self.client.vocab)  # refused now, not at the first token, if it cannot be honoured
        ids = None
        if prompt is not None:
            ids = self.client.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt, dtype=np.int64)
        return self._generate(ids, params)

    def _generate(self, ids, params: SamplingParams) -> Iterator[int]:
        lazy = self.client.lazy
        if ids is not None and ids.size:
            self._feed(ids, head=lazy)
        elif lazy and self.pending is None and self.last_log_probs is not None:
            self.last_head = self.client.clusters.head_from_full(self.last_log_probs)  # what an earlier feed() got
        if self.last_log_probs is None and self.last_head is None and self.pending is None:
            raise InputError("generate() needs a prompt: nothing has been sent in this conversation yet")
        sampler = None
        for _ in range(params.max_tokens):
            if self.pending is not None:
                self._feed([], head=lazy)
            if sampler is None:
                context = () if ids is None else ids.reshape(-1)
                if lazy:
                    sampler = Sampler(params, self.client.n_token, context=context, vocab=self.client.vocab,
                                      clusters=self.client.clusters)
                else:
                    sampler = Sampler(params, self.last_log_probs.size, context=context, vocab=self.client.vocab,
                                      clusters=self.client.clusters)  # the same decisions as the lazy path
            if lazy:  # the head, then only the tails this decision can depend on
                choice = sampler.start(self.latest_head())
                while choice.needs:
                    needs = choice.needs
                    for i, tail in zip(needs, self._tails(needs)):
                        choice.reveal(i, tail)
                tok = choice.token
            else:
                tok = sampler.choose(self.last_log_probs)
            self.pending = tok
            yield tok
            if sampler.stopped_by_token(tok):
                return

    def generate_text(self, prompt=None, max_new_tokens: int = 50, **sampling) -> Iterator[str]:
        """`generate`, as text: what can be printed after each token, decoded incrementally with the model's
        vocabulary (`Vocab.stream_decoder`: a character spelled over several byte tokens comes out once whole,
        bytes that are not UTF-8 as U+FFFD), then whatever an incomplete last character leaves. The pieces
        continue `prompt` (a word model's first word gets its leading space)."""
        vocab = self.client.vocab
        if vocab is None:
            raise InputError(f"model {self.client.model!r} publishes no vocabulary: pass "
                             f"--vocab <repo>/{self.client.model}/vocab.json")
        # the decoder is told the prompt's ids too: a Moses detokenizer continues the prompt's line as the whole
        # text's decode would (a "@-@" or "@,@" right after the prompt joins its last word)
        if isinstance(prompt, str):
            after, context = prompt, vocab.encode(prompt)
        elif prompt is None:
            after, context = CONTINUING, None
        else:
            after, context = vocab.decode(prompt), prompt
        tokens = self.generate(prompt, max_new_tokens=max_new_tokens, **sampling)
        yield from vocab.stream_decoder(after, context=context).pieces(tokens)

    # -- park / resume / move --------------------------------------------------------------------------------------
    def park(self) -> bytes:
        """End the conversation on its server and return its memory (bytes of an .npz with
        `TxlRuntime.save_state`'s arrays and the model's fingerprint): `client.resume(state)` continues it on any
        server of the same model, `TxlRuntime.load_state` in-process. A generated token not yet sent travels in
        the same request, so the state covers everything the conversation has seen."""
        with self._lock:
            if not self.started or self.ended:
                raise InputError(f"conversation {self.id} has {'ended' if self.ended else 'not started'}: "
                                 "nothing to park")
            tokens = [] if self.pending is None else [self.pending]
            positions = [] if self.pending is None else [0]
            result = self.client._request(self.server, self.id, tokens, positions, end=True, want_state=True,
                                          conversation=self)
            if self.pending is not None:
                self.last_log_probs, self.last_head = result.as_numpy(io_spec.LOG_PROBS)[0][0], None
                self.pending = None
            self.ended = True
            self._unregister()
            state = result.as_numpy(SAVED_OUTPUT).reshape(-1)
            return state.tobytes()

    def _resume(self, state: bytes, server: _Server):
        try:
            result = self.client._request(server, self.id, [], [], start=True, resume_state=state)
        except ServingError:
            # Triton opened the sequence before the model refused the state: end it, or it would hold a slot
            # until it idles out.
            try:
                self.client._request(server, self.id, [0], [0], end=True)
            except ServingError:
                pass  # the expected answer: the model does not know the conversation
            raise
        self.ended, self.pending, self.last_head = False, None, None
        last = result.as_numpy(io_spec.LOG_PROBS)[0][0]
        self.last_log_probs = None if np.isnan(last).all() else last
        self._register(server)

    def _move(self, url: str):
        state = self.park()
        self._resume(state, self.client.servers[url])

    def move(self, url: str):
        """Park this conversation on its server and resume it on `url` (same id); it continues exactly there."""
        if url not in self.client.servers:
            raise InputError(f"{url} is not one of this client's servers")
        with self._lock:
            if self.server is not None and self.server.url == url:
                return
            self._move(url)

    def close(self):
        """End the sequence on the server (frees its slot and memory). Triton ends a sequence only with a request,
        so the last generated token (or token 0 if there is none) travels with the END flag; a lazy client asks
        for the head of that step, which the server computes without the tails."""
        with self._lock:
            if self.started and not self.ended:
                tok = self.pending if self.pending is not None else 0
                self.pending = None
                self.ended = True
                self._unregister()
                self.client._request(self.server, self.id, [tok], [0], end=True, conversation=self,
                                     output=HEAD_OUTPUT if self.client.lazy else io_spec.LOG_PROBS)
            self.ended = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except ServingError:
            if exc_type is None:
                raise  # the original error matters more than a failed goodbye


def _first_line(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__
