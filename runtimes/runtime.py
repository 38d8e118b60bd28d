"""`TxlRuntime`: one interface over every backend, with the memory kept inside between calls.

As in Polygraphy's runners, the runtime owns the lifecycle (`with TxlRuntime.load(...) as rt:`) and checks every
input once, here, before a backend sees it; a backend only implements `run` on already-valid arrays. A rejected
call leaves the memory exactly as it was: validation happens first, and backends commit new state only after the
computation succeeded.

Rows of a batch are independent streams. The batch size is fixed by the first call after a full `reset()`.
Thread safety: every call that reads or changes the memory holds the runtime's lock, so a runtime may be shared
across threads without corrupting its memory; calls are serialised (for parallel streams, use batch rows or one
runtime per thread). generate() holds it per token, never while suspended at a `yield`.
"""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np

from txl_deploy.contract.clusters import Clusters
from txl_deploy.contract.io_spec import MEM_COUNT
from txl_deploy.errors import InputError
from txl_deploy.files import atomic_path
from txl_deploy.music.grammar import constraint
from txl_deploy.runtimes.arguments import whole
from txl_deploy.runtimes.backend import Backend
from txl_deploy.runtimes.beam_search import Beam, BeamParams, run_beam_search
from txl_deploy.runtimes.decoding import sample_full, sample_lazy
from txl_deploy.runtimes.registry import open_backend
from txl_deploy.runtimes.sampling import Sampler, SamplingParams, generation_params
from txl_deploy.runtimes.saved_state import read_saved_state, state_members
from txl_deploy.runtimes.scoring import BATCH_BUDGET_BYTES, score_chunk, score_texts
from txl_deploy.vocab import CONTINUING

GENERATE_DEFAULTS = dict(max_new_tokens=100, temperature=1.0, top_k=None, top_p=None, seed=None, stop=None)


class TxlRuntime:
    """Incremental Transformer-XL inference with the memory threaded between calls.

    >>> rt = TxlRuntime.load("model.onnx")
    >>> log_probs = rt.step([[12, 7, 99]])          # [1, 3, V], memory advanced by 3 tokens
    >>> for tok in rt.generate("The", max_new_tokens=20, seed=0): ...
    """

    def __init__(self, backend: Backend, lazy: bool = True):
        self.backend = backend
        # generate() through the adaptive softmax's parts where the backend has them; False: the full distribution
        # through the main graph, the same algorithm (docs/runtime.md says when the tokens are the same).
        self.lazy = bool(lazy)
        self._state = None
        self._last_log_probs = None  # [B, V] after each call: lets generate() continue without a prompt
        # Lazy decoding's counts (generate on a backend with the softmax's parts): decisions made, and per tail
        # cluster how many of them computed it.
        self.tail_stats = {"decisions": 0, "tails": [0] * (backend.config.n_clusters if backend.clusters else 0)}
        self._lock = threading.RLock()

    # -- construction --------------------------------------------------------------------------------------
    @classmethod
    def load(cls, path, backend: str | None = None, providers=None, device: str | None = None,
             mem_len: int | None = None, max_segment: int | None = None, clamp_len: int | None = None,
             same_length: bool | None = None, threads: int | None = None,
             tokenizer: str | None = None, lazy: bool = True) -> "TxlRuntime":
        """Open a model. `.onnx` -> ONNX Runtime (providers automatic or named), `.engine` -> TensorRT,
        `.pte` -> ExecuTorch (the program and its `.pte.json` sidecar), a checkpoint -> the PyTorch eager reference
        (`backend="torch-fast"` for the cached PyTorch path).
        `mem_len`, `max_segment`, `clamp_len` and `same_length` override a checkpoint's settings (an exported
        graph has them built in: asking for other values, or a longer max_segment, is an error that says to
        re-export; a shorter max_segment feeds input in shorter pieces).

        threads: CPU threads for the computation [default: each library's own, which is every core].
        ONNX Runtime: this session's intra-op threads, with one inter-op thread (the graph runs sequentially).
        PyTorch backends: `torch.set_num_threads(threads)`, which is process-wide in PyTorch, so it also applies
        to every other torch model in the process. TensorRT: no effect (the model runs on the GPU); a
        RuntimeWarning says so rather than dropping the setting silently. ExecuTorch: the size of its thread pool,
        which every ExecuTorch program in the process shares and which can only be resized while no other `.pte`
        is open (otherwise a RuntimeWarning says the setting is not applied).
        Fix it whenever two models share a process (say an ONNX Runtime session beside an eager reference):
        at the defaults each library starts a thread per core and they contend for the same cores.

        tokenizer: how a word model reads and writes text for this runtime ("whitespace", "wikitext", "lm1b";
        see `set_tokenizer`) [default: the vocabulary's own, stored with the model].

        lazy: on a backend with the adaptive softmax's parts, `generate` computes each step's head and only the
        tails its sampler asks for [default]; False runs the same decision on the head derived from every step's
        full distribution: the same tokens whenever that head and the tails are bit for bit what the parts compute,
        else a draw within float rounding of a boundary may differ (docs/runtime.md). Also the `lazy` attribute."""
        rt = cls(open_backend(path, backend, providers=providers, device=device, mem_len=mem_len,
                              max_segment=max_segment, clamp_len=clamp_len, same_length=same_length,
                              threads=threads), lazy=lazy)
        if tokenizer is not None:
            rt.set_tokenizer(tokenizer)
        return rt

    def set_tokenizer(self, tokenizer: str):
        """Read and write text with another word tokenizer from now on (the model's file is unchanged): the
        vocabulary's `with_tokenizer`. InputError for a model without a vocabulary, or one of characters or
        bytes, which has no word tokenizer."""
        if self.vocab is None:
            raise InputError(f"tokenizer {tokenizer}: this model has no vocabulary")
        try:
            self.backend.vocab = self.vocab.with_tokenizer(tokenizer)  # the vocabulary is the backend's
        except ValueError as e:
            raise InputError(f"tokenizer {tokenizer}: {e}") from None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        with self._lock:
            self._state = None
            self.backend.close()

    # -- properties ----------------------------------------------------------------------------------------
    @property
    def config(self):
        return self.backend.config

    @property
    def vocab(self):
        return self.backend.vocab

    @property
    def mem_len(self) -> int:
        return self.backend.mem_len

    @property
    def n_token(self) -> int:
        return self.backend.config.n_token

    @property
    def threads(self) -> int | None:
        """CPU threads given to `load` (None: the library's default)."""
        return self.backend.threads

    @property
    def batch_size(self) -> int | None:
        return None if self._state is None else self.backend.state_batch(self._state)

    def __repr__(self):
        return (f"TxlRuntime(backend={self.backend.name}, n_token={self.n_token}, mem_len={self.mem_len}, "
                f"batch={self.batch_size})")

    # -- validation (one place for every backend) -----------------------------------------------------------
    def _check_tokens(self, tokens) -> np.ndarray:
        arr = np.asarray(tokens)
        if arr.dtype == object or not (np.issubdtype(arr.dtype, np.integer)):
            raise InputError(f"token ids must be integers, got dtype {arr.dtype}")
        if arr.ndim != 2:
            raise InputError(f"tokens must have shape [batch, segment], got rank {arr.ndim} shape {arr.shape}")
        if arr.shape[0] < 1 or arr.shape[1] < 1:
            raise InputError(f"tokens must have at least one row and one position, got shape {arr.shape}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.n_token:
            bad = lo if lo < 0 else hi
            raise InputError(f"token id {bad} is outside the vocabulary [0, {self.n_token})")
        if self._state is not None and arr.shape[0] != self.backend.state_batch(self._state):
            raise InputError(f"batch size {arr.shape[0]} does not match the runtime's memory "
                             f"({self.backend.state_batch(self._state)} rows); call reset() to start new streams")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def _ensure_state(self, batch: int):
        if self._state is None:
            self._state = self.backend.new_state(batch)

    # -- the calls -----------------------------------------------------------------------------------------
    def step(self, tokens, positions=None, advance: bool = True) -> np.ndarray:
        """Feed tokens [B, Q]; return log-probabilities [B, Q, V] (float32) of the next token at each position.

        Longer segments than the model's max_segment are fed in pieces: the result is the same.
        positions: only these segment positions' log-probabilities, [B, P] (a list of ints is the same for every
        row); the graph then applies its output layer there alone. Needs Q <= max_segment.
        advance=False (with positions): leave the memory as it was, so that the same segment can be asked for other
        positions (host-ring backends: ONNX Runtime on the CPU, ExecuTorch, torch-fast; others raise InputError)."""
        with self._lock:
            tokens = self._check_tokens(tokens)
            if positions is None:
                if not advance:
                    raise InputError("advance=False needs positions")
                return self._feed(tokens, want="all")
            return self._feed_positions(tokens, self._check_positions(positions, tokens.shape), advance)

    def _check_positions(self, positions, shape) -> np.ndarray:
        B, Q = shape
        arr = np.asarray(positions)
        if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
            raise InputError(f"positions must be integers, got dtype {arr.dtype}")
        if arr.ndim == 1:
            arr = np.broadcast_to(arr, (B, arr.shape[0]))
        if arr.ndim != 2 or arr.shape[0] != B or arr.shape[1] < 1:
            raise InputError(f"positions must have shape [P] or [{B}, P] with P >= 1, got {np.shape(positions)}")
        if Q > self.backend.max_segment:
            raise InputError(f"positions need a segment of at most max_segment ({self.backend.max_segment}) "
                             f"tokens, got {Q}")
        if int(arr.min()) < 0 or int(arr.max()) >= Q:
            raise InputError(f"positions must lie in [0, {Q}) for a segment of {Q} tokens")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def _feed_positions(self, tokens, positions, advance: bool = True) -> np.ndarray:
        self._ensure_state(tokens.shape[0])
        if not advance:
            try:
                return self.backend.run_fixed(self._state, tokens, positions)
            except NotImplementedError as e:
                raise InputError(f"{e}: advance=False is not available here; use save_state()/load_state()") from None
        lp = self.backend.run(self._state, tokens, positions)
        ends_at_last = bool((positions[:, -1] == tokens.shape[1] - 1).all())
        self._last_log_probs = lp[:, -1].copy() if ends_at_last else None  # what generate() would continue from
        return lp

    def prefill(self, tokens) -> np.ndarray:
        """Feed tokens [B, Q]; return only the last position's log-probabilities [B, V].

        Never materialises [B, Q, V] (a 512-token segment over 267,735 words would be 548 MB)."""
        with self._lock:
            tokens = self._check_tokens(tokens)
            return self._feed(tokens, want="last")

    def _feed(self, tokens: np.ndarray, want: str):
        B, Q = tokens.shape
        self._ensure_state(B)
        pieces = []
        step = self.backend.max_segment
        for start in range(0, Q, step):
            seg = tokens[:, start:start + step]
            q = seg.shape[1]
            if want == "all":
                positions = np.broadcast_to(np.arange(q, dtype=np.int64), (B, q))
            else:
                positions = np.full((B, 1), q - 1, dtype=np.int64)
            lp = self.backend.run(self._state, seg, np.ascontiguousarray(positions))
            if want == "all":
                pieces.append(lp)
            # a copy, not a view: a view would keep the whole [B, Q, V] block alive (548 MB for 512 words)
            self._last_log_probs = lp[:, -1].copy()
        if want == "all":
            return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)
        return self._last_log_probs

    def reset(self, rows=None):
        """Forget the memory: of every row (the next call may use any batch size), or of the given rows only."""
        with self._lock:
            if rows is None:
                self._state, self._last_log_probs = None, None
                return
            if self._state is None:
                raise InputError("reset(rows) needs a running batch; call step() first or reset() without rows")
            idx = self._row_index(rows, "rows")
            self.backend.reset_rows(self._state, idx)
            if self._last_log_probs is not None:
                self._last_log_probs = self._last_log_probs.copy()
                self._last_log_probs[idx] = np.nan  # no prediction for a fresh row until it is fed

    def start_from_zero_memory(self, batch: int = 1):
        """Start `batch` new streams from `mem_len` zero vectors per layer that are attended to as context: the first
        memory of the original TensorFlow evaluation (and of HuggingFace), for reproducing their numbers exactly.
        The default (`reset()`) is the paper's empty memory; the two agree after ~n_layer*ceil(mem_len/segment)
        segments."""
        if self.config.pre_lnorm:
            # A zero hidden state projects to zero keys and values only without a layer norm in front.
            raise InputError("a zero-filled first memory is supported for post-layer-norm models only")
        with self._lock:
            arrays = self.backend.state_arrays(self.backend.new_state(int(batch)))
            if MEM_COUNT in arrays:  # key/value ring buffers: zeros are what a zero hidden state projects to
                arrays[MEM_COUNT][:] = self.mem_len
            else:  # the eager reference keeps hidden states: mem_len of them, all zero
                arrays["lens"][:] = self.mem_len
            self._state = self.backend.state_from_arrays(arrays)
            self._last_log_probs = None

    def score(self, tokens) -> np.ndarray:
        """Negative log-likelihood (nats) of tokens[:, 1:] given what precedes them: returns [B, Q - 1].

        The memory advances over all of `tokens`; log-probs are materialised only in bounded chunks."""
        with self._lock:
            tokens = self._check_tokens(tokens)
            B, Q = tokens.shape
            if Q < 2:
                raise InputError("score() needs at least two tokens per row")
            self._ensure_state(B)
            chunk = score_chunk(self.backend, B)
            nll = np.empty((B, Q - 1), dtype=np.float64)
            rows = np.arange(B)[:, None]
            for start in range(0, Q - 1, chunk):
                seg = tokens[:, start:min(start + chunk, Q - 1)]  # the last token is fed below, once
                q = seg.shape[1]
                positions = np.ascontiguousarray(np.broadcast_to(np.arange(q, dtype=np.int64), (B, q)))
                lp = self.backend.run(self._state, seg, positions)
                nll[:, start:start + q] = -lp[rows, np.arange(q)[None], tokens[:, start + 1:start + 1 + q]]
            # the last token is fed too, so the memory covers the whole input
            self._last_log_probs = self.backend.run(self._state, tokens[:, Q - 1:], np.zeros((B, 1), np.int64))[:, -1]
            return nll

    def score_texts(self, items, *, per_token: bool = False, batch_budget: int = BATCH_BUDGET_BYTES,
                    start: bool = True, line_end: bool = False, progress: bool = False) -> list[dict]:
        """Score many texts at batch speed: for each item (a str, or a `ScoreItem`/dict with `text`, optional
        `context` and `group`) its total log-prob (nats), counted tokens and perplexity, in input order; a bad item
        gets {"error": ...}. Items sharing a context (or a group) are scored from one reading of it, forked into a
        row each. Uses the memory and leaves it empty. Arguments and what is counted: runtimes/scoring.py,
        docs/scoring.md."""
        with self._lock:
            return score_texts(self, items, per_token=per_token, batch_budget=batch_budget, start=start,
                               line_end=line_end, progress=progress)

    # -- state -----------------------------------------------------------------------------------------------
    def select_rows(self, rows):
        """Make row r of the memory (and of the last distribution) what row rows[r] holds now, for every r: the
        batch becomes len(rows). Forks a prefix read once into several streams (`select_rows([0] * n)`) and
        reorders beams; each row is a copy, and writing one never changes another."""
        with self._lock:
            index = self._row_index(rows, "rows")
            if not index.size:
                raise InputError("select_rows() needs at least one row")
            self._state = self.backend.select_rows(self._state, index)
            if self._last_log_probs is not None:
                self._last_log_probs = self._last_log_probs[index]

    def copy_rows(self, src, dst):
        """Copy the memory (and last distribution) of rows `src` into rows `dst` (lists of equal length; a row may
        be copied to several); the other rows keep theirs."""
        with self._lock:
            src, dst = self._row_index(src, "src"), self._row_index(dst, "dst")
            if src.shape != dst.shape or len(set(dst.tolist())) != dst.size:
                raise InputError("copy_rows() needs src and dst of equal length, each dst row named once")
            self._state = self.backend.copy_rows(self._state, src, dst)
            if self._last_log_probs is not None:
                self._last_log_probs = self._last_log_probs.copy()
                self._last_log_probs[dst] = self._last_log_probs[src]

    def _row_index(self, rows, what: str) -> np.ndarray:
        if self._state is None:
            raise InputError(f"there is no memory to take {what} from yet: call step() first")
        batch = self.backend.state_batch(self._state)
        idx = np.atleast_1d(np.asarray(rows))
        if idx.ndim != 1 or not (idx.size == 0 or np.issubdtype(idx.dtype, np.integer)):
            raise InputError(f"{what} must be a list of row indices, got {str(rows)[:60]}")
        if idx.size and (idx.min() < 0 or idx.max() >= batch):
            bad = int(idx.max() if idx.max() >= batch else idx.min())
            raise InputError(f"row {bad} is outside the batch [0, {batch})")
        return idx.astype(np.int64)

    def save_state(self, path=None) -> dict:
        """The memory as plain numpy arrays (with the model's fingerprint), to park a conversation and resume it.

        With `path`, also written atomically as an .npz file."""
        with self._lock:
            if self._state is None:
                raise InputError("there is no memory to save yet: call step() first")
            arrays = state_members(self.backend, {k: np.array(v, copy=True) for k, v in
                                                  self.backend.state_arrays(self._state).items()}, self._last_log_probs)
        if path is not None:
            with atomic_path(path, force=True) as tmp:
                with open(tmp, "wb") as f:
                    np.savez(f, **arrays)
        return arrays

    def load_state(self, state, max_rows: int | None = None):
        """Resume from a saved state: `save_state()`'s dict, the bytes of its .npz file, or the file's path.

        The safe entry point for a state that comes from outside (a parked conversation a client sends back): the
        archive is checked before it is read (member names; each tensor's dtype and shape against this model's
        state; sizes against the archive's own; the fingerprint), so a bomb, a truncated or damaged file, or a
        state of another model raises InputError and leaves the memory as it was; reading costs the state's own
        size and no more (see runtimes.saved_state). max_rows: the most rows (streams) to accept; without it, an
        archive may expand to no more rows than its own bytes hold (at least one), which every save_state() file
        meets."""
        saved = read_saved_state(state, self.backend, max_rows)
        fresh = not isinstance(state, dict)  # arrays just read from a file are ours to keep: no second copy
        with self._lock:
            new_state = self.backend.state_from_arrays(saved.arrays, copy=not fresh)  # validates shapes, dtypes
            self._state = new_state
            self._last_log_probs = saved.last_log_probs

    # -- generation ----------------------------------------------------------------------------------------
    def encode(self, text: str) -> np.ndarray:
        if self.vocab is None:
            raise InputError("this model has no vocabulary: pass token ids instead of text")
        return self.vocab.encode(text)

    def decode(self, ids) -> str:
        if self.vocab is None:
            raise InputError("this model has no vocabulary: cannot turn token ids into text")
        return self.vocab.decode(ids)

    def stream_decoder(self, after: str = ""):
        """The vocabulary's incremental decoder (`Vocab.stream_decoder`): `feed(id)` -> the text to print now,
        `flush()` -> the rest at the end. A character spelled over several byte tokens comes out once whole."""
        if self.vocab is None:
            raise InputError("this model has no vocabulary: cannot turn token ids into text")
        return self.vocab.stream_decoder(after)

    def generate_text(self, prompt=None, max_new_tokens: int = 100, **sampling) -> Iterator[str]:
        """`generate`, as text: yields what can be printed after each token (never part of a character; "" pieces
        are skipped) and, at the end, whatever an incomplete last character leaves (U+FFFD). The pieces continue
        `prompt`: joined to it, they are the text (a word model's first word gets its leading space).
        Arguments as `generate`, checked now."""
        if self.vocab is None:
            raise InputError("this model has no vocabulary: cannot turn token ids into text")
        tokens = self.generate(prompt, max_new_tokens, **sampling)
        # the decoder is told the prompt's ids too: a Moses detokenizer continues the prompt's line as the whole
        # text's decode would (a "@-@" or "@,@" right after the prompt joins its last word)
        if isinstance(prompt, str):
            after, context = prompt, self.vocab.encode(prompt)
        elif prompt is None:
            after, context = CONTINUING, None
        else:
            after, context = self.vocab.decode(prompt), prompt
        return self.vocab.stream_decoder(after, context=context).pieces(tokens)

    def generate(self, prompt=None, max_new_tokens: int = 100, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int | None = None, stop=None, *,
                 params: SamplingParams | None = None, grammar=None, **controls) -> Iterator[int]:
        """Yield new token ids one at a time (batch of one stream), continuing the current memory.

        prompt: text (needs the vocabulary) or token ids; None continues from the last call.
        temperature 0 is greedy; top_k / top_p filter before sampling; `seed` makes sampling reproducible.
        stop: token ids that end generation (yielded, then stop).
        controls: the other token-level sampling parameters by name (min_p, repetition_penalty, presence_penalty,
        frequency_penalty, no_repeat_ngram_size, logit_bias, min_tokens, ban_unk=True to keep `<unk>` out of the
        text; see runtimes/sampling/), or all of them as one `params=SamplingParams(...)` (whose max_tokens and
        stop_token_ids then apply). Stop strings and log-probs belong to text responses: asking for them is an error.
        grammar: only tokens a music grammar allows next ("remi", "remi-xl"; a name starts after the prompt, a
        `GrammarState` goes on with a piece across calls), so the MIDI writer places every event (docs/music.md).

        Every argument, the prompt and the stream are checked here, when generate() is called, before anything
        touches the memory: a rejected call raises InputError at once and leaves the memory as it was. The prompt
        is fed when the first token is asked for. The lock is held for each step, not between tokens, so a
        generator left suspended (abandoned, or driven from another thread) never blocks other callers; their
        calls between two tokens advance the same memory, as any call on a shared runtime does."""
        max_new_tokens = whole("max_new_tokens", max_new_tokens, lo=0)
        given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                     stop=stop)
        params = generation_params("TxlRuntime.generate()", params, given, GENERATE_DEFAULTS, controls)
        params.check_vocabulary(self.n_token)
        ids = self._prompt_row(prompt, "generate()")
        with self._lock:
            if ids is not None:
                ids = self._check_tokens(ids)  # ids in the vocabulary; one row needs a memory of one row
            else:
                self._check_can_continue()
        # An adaptive softmax's decisions are the cluster-factored ones on every backend (runtimes/sampling/), so the
        # lazy path (head first, tails as asked) and the full path run one algorithm (docs/sampling.md).
        context = () if ids is None else ids[0]
        sampler = Sampler(params, self.n_token, context=context, vocab=self.vocab, clusters=Clusters.of(self.config),
                          constraint=None if grammar is None else constraint(grammar, self.vocab, context))
        if self.lazy and self.backend.clusters is not None:
            return sample_lazy(self, ids, sampler)
        return sample_full(self, ids, sampler)

    def _prompt_row(self, prompt, what: str) -> np.ndarray | None:
        """A prompt (text or ids [Q] or [1, Q]) as ids [1, Q], unchecked against the vocabulary; None (also for an
        empty prompt): continue from the last call."""
        if prompt is None:
            return None
        ids = self.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt)
        if ids.ndim == 2 and ids.shape[0] != 1:
            raise InputError(f"{what} runs one stream, but the prompt has {ids.shape[0]} rows; pass one "
                             "row (for several streams, use step()/prefill() with batch rows)")
        if ids.ndim not in (1, 2):
            raise InputError(f"the prompt must be text or token ids [Q] or [1, Q], got shape {ids.shape}")
        return ids.reshape(1, -1) if ids.size else None

    def beam_search(self, prompt=None, num_beams: int = 4, max_new_tokens: int = 100, *, length_penalty: float = 1.0,
                    early_stopping: bool | str = False, num_return_sequences: int = 1, stop=None) -> list[Beam]:
        """The num_return_sequences best hypotheses of a beam search, best first: `Beam(tokens, score)` with the
        generated ids (a stop id that ended one is its last) and `sum log p / len(tokens) ** length_penalty`.

        Decodes as HuggingFace's `generate(num_beams=..., do_sample=False)` with the same arguments (stop: its
        eos_token_id, ids that end a hypothesis; early_stopping True, False or "never"); docs/beam_search.md. The
        beams are num_beams rows of the memory, reordered in place each step. The prompt (text or ids; None
        continues from the last call) is read once, and the stream is left holding it, one row, as if no beam had
        been decoded: feed the chosen beam's tokens to go on with it. Arguments are checked before anything is fed."""
        params = BeamParams.checked(self.n_token, num_beams, max_new_tokens, length_penalty, early_stopping,
                                    num_return_sequences, stop)
        ids = self._prompt_row(prompt, "beam_search()")
        with self._lock:
            if ids is not None:
                ids = self._check_tokens(ids)
            else:
                self._check_can_continue("beam_search()")
            return run_beam_search(self, ids, params)

    def _check_can_continue(self, what: str = "generate()"):
        if self._last_log_probs is None or self.batch_size is None:
            raise InputError(f"{what} needs a prompt (nothing has been fed to this stream yet)")
        if self.batch_size != 1:
            raise InputError(f"{what} runs one stream, but the memory holds {self.batch_size} rows; reset() "
                             "and feed a single row")
        if np.isnan(self._last_log_probs[0]).any():
            raise InputError(f"{what} needs a prompt (this stream was reset since its last call)")
