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

import json
import threading
import time
from typing import Iterator

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import InputError
from txl_deploy.runtimes.saved_state import read_state_metadata
from txl_deploy.serving.triton.conversation import Conversation
from txl_deploy.serving.triton.protocol import (
    CUTOFFS_PARAM,
    PARAM_PREFIX,
    RESUME_INPUT,
    SAVED_OUTPUT,
    TAIL_INPUT,
    UNKNOWN_SEQUENCE,
    UNKNOWN_TO_MODEL,
)
from txl_deploy.serving.triton.servers import (
    LOST_RETRY_S,
    Server,
    ServingError,
    first_line,
    rendezvous_order,
)
from txl_deploy.vocab import Vocab


class TxlTritonClient:
    def __init__(self, url, model: str = "txl", vocab=None, timeout: float = 60.0, lazy: bool = False):
        urls = [url] if isinstance(url, str) else list(url)
        if not urls:
            raise ServingError("no server URL given")
        if len(set(urls)) != len(urls):
            raise ServingError(f"a server URL is listed twice: {urls}")
        self.model, self.timeout = model, timeout
        self.servers = {u: Server(u, model, timeout) for u in urls}
        self._where = {}  # sequence id -> Server, for this client's live conversations
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

    def _mark_lost(self, server: Server, reason: str):
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
    def _call(self, server: Server, fn, *args, conversation=None, **kwargs):
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # tritonclient raises its own exception, socket errors, gevent and grpc errors
            raise self._translate(server, e, kwargs.get("sequence_id"), conversation) from None
        server.lost_at = server.lost_reason = None
        return out

    def _translate(self, server: Server, e: Exception, sequence_id, conversation=None) -> ServingError:
        message = first_line(e)
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

    def _model_params(self, server: Server) -> dict:
        if server.protocol == "grpc":
            config = self._call(server, server.client.get_model_config, self.model, as_json=True,
                                client_timeout=self.timeout).get("config", {})
        else:
            config = self._call(server, server.client.get_model_config, self.model)
        return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}

    def _server_for(self, sequence_id: int) -> Server:
        return self._where.get(int(sequence_id)) or self.servers[self.route(sequence_id)]

    def _request(self, server: Server, sequence_id: int, tokens, out_positions, start=False, end=False,
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

    def conversation(self, sequence_id: int | None = None) -> Conversation:
        return Conversation(self, sequence_id)

    def resume(self, state, sequence_id: int | None = None, url: str | None = None) -> Conversation:
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
        raise InputError(f"not a parked conversation state ({first_line(e)})") from None
    out = {"fingerprint": meta.get("__fingerprint__"), "format_version": meta.get("__format_version__"),
           "sequence_id": meta.get("__sequence_id__")}
    if out["fingerprint"] is None:
        raise InputError("not a parked conversation state (no fingerprint)")
    out["sequence_id"] = None if out["sequence_id"] is None else int(out["sequence_id"])
    return out
