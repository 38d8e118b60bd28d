"""Stream generation from a Triton server that serves a txl-deploy model (any backend `triton-repo` writes).

One conversation = one Triton sequence id: the first request carries `sequence_start`, the last `sequence_end`, and
the server keeps the conversation's memory in between, so each request sends only new tokens.

>>> client = TxlTritonClient("http://localhost:8000")          # or grpc://localhost:8001
>>> with client.conversation() as conv:
...     for tok in conv.generate("the history of", max_new_tokens=20):
...         print(client.vocab.decode([tok]), end=" ")

Needs `tritonclient[http]` or `tritonclient[grpc]`; numpy only otherwise (no torch).
"""

from __future__ import annotations

import json
import secrets
from typing import Iterator

import numpy as np

from txl_deploy import io_spec
from txl_deploy.errors import InputError, TxlError
from txl_deploy.vocab import Vocab

PARAM_PREFIX = "txl_deploy."
UNKNOWN_SEQUENCE = "must specify the START flag"


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


class TxlTritonClient:
    def __init__(self, url: str, model: str = "txl", vocab=None, timeout: float = 60.0):
        self.url, self.model, self.timeout = url, model, timeout
        self.protocol, address = split_url(url)
        try:
            if self.protocol == "grpc":
                import tritonclient.grpc as tc
            else:
                import tritonclient.http as tc
        except ImportError as e:
            raise ServingError(f"the Triton client is not installed: pip install 'tritonclient[all]' ({e})") from None
        self._tc = tc
        try:
            if self.protocol == "grpc":
                self._client = tc.InferenceServerClient(address)
            else:
                self._client = tc.InferenceServerClient(address, connection_timeout=timeout, network_timeout=timeout)
        except Exception as e:  # bad address syntax
            raise ServingError(f"cannot connect to {url}: {_first_line(e)}") from None
        self.params = self._model_params()
        self.max_segment = int(self.params.get(PARAM_PREFIX + "max_segment", 0) or 0) or None
        self.n_token = int(self.params.get(PARAM_PREFIX + "n_token", 0) or 0) or None
        if vocab is not None:
            self.vocab = vocab if isinstance(vocab, Vocab) else Vocab.read(vocab)
        elif PARAM_PREFIX + "vocab" in self.params:
            self.vocab = Vocab.from_dict(json.loads(self.params[PARAM_PREFIX + "vocab"]))
        else:
            self.vocab = None

    # -- plumbing --------------------------------------------------------------------------------------------------
    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # tritonclient raises its own exception, socket errors, gevent and grpc errors
            raise self._translate(e, kwargs.get("sequence_id")) from None

    def _translate(self, e: Exception, sequence_id) -> ServingError:
        message = _first_line(e)
        if UNKNOWN_SEQUENCE in message:
            return ServingError(f"the server at {self.url} does not know conversation {sequence_id} (it ended, "
                                "idled out, or the server restarted since it began): start a new conversation")
        status = e.status() if callable(getattr(e, "status", None)) else None  # grpc: "StatusCode.UNAVAILABLE"
        unreachable = isinstance(e, (ConnectionError, OSError, TimeoutError)) or "UNAVAILABLE" in str(status) or \
            any(s in message for s in ("Connection refused", "failed to connect", "connection reset",
                                       "Socket closed", "Broken pipe", "timed out", "Deadline Exceeded"))
        if unreachable:
            return ServingError(f"cannot reach Triton at {self.url} ({message})")
        return ServingError(f"Triton refused the request: {message}")

    def _model_params(self) -> dict:
        if self.protocol == "grpc":
            config = self._call(self._client.get_model_config, self.model, as_json=True,
                                client_timeout=self.timeout).get("config", {})
        else:
            config = self._call(self._client.get_model_config, self.model)
        return {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}

    def infer(self, sequence_id: int, tokens, out_positions, start: bool = False, end: bool = False) -> np.ndarray:
        """One request of a conversation: tokens [Q] -> log_probs [P, V] at out_positions [P]."""
        tokens = np.ascontiguousarray(np.asarray(tokens, dtype=np.int64).reshape(1, -1))
        positions = np.ascontiguousarray(np.asarray(out_positions, dtype=np.int64).reshape(1, -1))
        inputs = []
        for name, array in ((io_spec.TOKENS, tokens), (io_spec.OUT_POSITIONS, positions)):
            inp = self._tc.InferInput(name, list(array.shape), "INT64")
            inp.set_data_from_numpy(array)
            inputs.append(inp)
        outputs = [self._tc.InferRequestedOutput(io_spec.LOG_PROBS)]
        extra = {"client_timeout": self.timeout} if self.protocol == "grpc" else {}
        result = self._call(self._client.infer, self.model, inputs, outputs=outputs, sequence_id=int(sequence_id),
                            sequence_start=bool(start), sequence_end=bool(end), **extra)
        return result.as_numpy(io_spec.LOG_PROBS)[0]

    def conversation(self, sequence_id: int | None = None) -> "Conversation":
        return Conversation(self, sequence_id)

    def encode(self, text: str) -> np.ndarray:
        if self.vocab is None:
            raise InputError(f"model {self.model!r} publishes no vocabulary: pass --vocab <repo>/{self.model}/vocab.json")
        return self.vocab.encode(text)

    def generate(self, prompt, max_new_tokens: int = 50, **sampling) -> Iterator[int]:
        """A whole conversation: prompt in, new tokens out one at a time, ended (slot freed) afterwards."""
        with self.conversation() as conv:
            yield from conv.generate(prompt, max_new_tokens=max_new_tokens, **sampling)

    def close(self):
        try:
            self._client.close()
        except Exception:
            pass


class Conversation:
    """One sequence on the server. Tokens are sent once; the server's memory carries the rest."""

    def __init__(self, client: TxlTritonClient, sequence_id: int | None = None):
        self.client = client
        self.id = int(sequence_id) if sequence_id is not None else new_sequence_id()
        if self.id <= 0:
            raise InputError("sequence ids must be positive integers (Triton reserves 0)")
        self.started = False
        self.ended = False
        self.pending = None  # a generated token the server has not been fed yet
        self.last_log_probs = None

    def feed(self, ids) -> np.ndarray:
        """Send token ids (split into pieces the server accepts); returns the next-token log-probs [V]."""
        if self.ended:
            raise InputError(f"conversation {self.id} has ended")
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if self.pending is not None:
            ids = np.concatenate([[self.pending], ids])
            self.pending = None
        if ids.size == 0:
            raise InputError("nothing to send: the prompt is empty")
        step = self.client.max_segment or ids.size
        for lo in range(0, ids.size, step):
            piece = ids[lo:lo + step]
            self.last_log_probs = self.client.infer(self.id, piece, [piece.size - 1], start=not self.started)[0]
            self.started = True
        return self.last_log_probs

    def generate(self, prompt=None, max_new_tokens: int = 50, temperature: float = 0.0, top_k=None, top_p=None,
                 seed=None, stop=None) -> Iterator[int]:
        """Yield new token ids as they are produced (temperature 0: greedy), continuing this conversation."""
        from txl_deploy.runtimes.base import sample

        if prompt is not None:
            ids = self.client.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt, dtype=np.int64)
            if ids.size:
                self.feed(ids)
        if self.last_log_probs is None and self.pending is None:
            raise InputError("generate() needs a prompt: nothing has been sent in this conversation yet")
        stop = set() if stop is None else {int(s) for s in np.atleast_1d(stop)}
        rng = np.random.default_rng(seed)
        for n in range(max_new_tokens):
            if self.pending is not None:
                self.feed([])
            tok = sample(self.last_log_probs, temperature, top_k, top_p, rng)
            self.pending = tok
            yield tok
            if tok in stop:
                return

    def close(self):
        """End the sequence on the server (frees its slot and memory). Triton ends a sequence only with a request,
        so the last generated token (or token 0 if there is none) travels with the END flag."""
        if self.started and not self.ended:
            tok = self.pending if self.pending is not None else 0
            self.pending = None
            self.ended = True
            self.client.infer(self.id, [tok], [0], end=True)
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
