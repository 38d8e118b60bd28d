"""One conversation with a Triton server: its sequence id, the server that holds its memory, feeding, generating,
parking and moving it. Made by `TxlTritonClient.conversation()` / `resume()` (client.py)."""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.errors import InputError
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, generation_params, unk_id
from txl_deploy.serving.triton.protocol import HEAD_OUTPUT, SAVED_OUTPUT, TAIL_OUTPUT
from txl_deploy.serving.triton.servers import Server, ServingError, new_sequence_id
from txl_deploy.vocab import CONTINUING

GENERATE_DEFAULTS = dict(max_new_tokens=50, temperature=0.0, top_k=None, top_p=None, seed=None, stop=None)


class Conversation:
    """One sequence on one server. Tokens are sent once; the server's memory carries the rest. `client` is the
    `TxlTritonClient` that made it (its servers, routing and requests)."""

    def __init__(self, client, sequence_id: int | None = None):
        self.client = client
        self.id = int(sequence_id) if sequence_id is not None else new_sequence_id()
        if self.id <= 0:
            raise InputError("sequence ids must be positive integers (Triton reserves 0)")
        self.started = False
        self.ended = False
        self.server = None  # the Server holding the memory, fixed at the first request
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

    def feed_all(self, ids) -> np.ndarray:
        """Send token ids as feed() does, returning the next-token log-probs at each of their positions [len(ids),
        V] (scoring them); the caller bounds how many it sends at once."""
        return self._feed(ids, head=False, every=True)

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

    def _feed(self, ids, head: bool, every: bool = False) -> np.ndarray:
        """feed(); with head=True the server returns only the head of each distribution (`last_head`); with
        every=True the distributions at every position of `ids` (feed_all)."""
        output = HEAD_OUTPUT if head else io_spec.LOG_PROBS
        with self._lock:
            if self.ended:
                raise InputError(f"conversation {self.id} has ended")
            ids = np.asarray(ids, dtype=np.int64).reshape(-1)
            skip = int(self.pending is not None)  # every=True: the pending token's position is not asked for
            if self.pending is not None:
                ids = np.concatenate([[self.pending], ids])
                self.pending = None
            if ids.size == 0:
                raise InputError("nothing to send: the prompt is empty")
            step = self.client.max_segment or ids.size
            server = self.server or self.client.servers[self.client.route(self.id)]
            rows = []
            for lo in range(0, ids.size, step):
                piece = ids[lo:lo + step]
                positions = np.arange(piece.size) if every else [piece.size - 1]
                result = self.client._request(server, self.id, piece, positions, start=not self.started,
                                              conversation=self, output=output)
                out = result.as_numpy(output)[0]
                last = out[-1]
                if every:
                    rows.append(out)
                self.received += out.size
                self.last_log_probs, self.last_head = (None, last) if head else (last, None)
                if not self.started:
                    self._register(server)
            return np.concatenate(rows)[skip:] if every else last

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
        return self._saved(end=True)

    def save(self) -> bytes:
        """The memory as `park()` returns it, the conversation going on: resuming the bytes under another id
        forks it."""
        return self._saved(end=False)

    def _saved(self, end: bool) -> bytes:
        with self._lock:
            if not self.started or self.ended:
                raise InputError(f"conversation {self.id} has {'ended' if self.ended else 'not started'}: "
                                 f"nothing to {'park' if end else 'save'}")
            tokens = [] if self.pending is None else [self.pending]
            positions = [] if self.pending is None else [0]
            result = self.client._request(self.server, self.id, tokens, positions, end=end, want_state=True,
                                          conversation=self)
            if self.pending is not None:
                self.last_log_probs, self.last_head = result.as_numpy(io_spec.LOG_PROBS)[0][0], None
                self.pending = None
            if end:
                self.ended = True
                self._unregister()
            state = result.as_numpy(SAVED_OUTPUT).reshape(-1)
            return state.tobytes()

    def _resume(self, state: bytes, server: Server):
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
