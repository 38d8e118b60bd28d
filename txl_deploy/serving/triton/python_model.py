"""Triton Python-backend model serving a txl-deploy model with one batched runtime call per Triton batch.

`txl-deploy triton-repo --backend python` copies this file to `<repo>/<model>/1/model.py`; it runs inside Triton's
Python-backend stub, never inside txl-deploy itself. Every conversation is a Triton sequence (sequence_id =
CORRID): START gives it a fresh memory (or the memory of a parked conversation), each request continues it, END
forgets it.

The memories live as the rows of ONE batched backend state per model instance (`RowPool`, in
txl_deploy/serving/rows.py, which the HTTP server uses too): a conversation owns a row from START to END.
`execute()` gets the requests the sequence batcher put together (at most one per conversation), groups them by
segment length (a shorter segment cannot be padded with tokens: every token fed enters the memory), pads their `out_positions` to the longest in the group (repeating the last position, sliced
off afterwards) and runs each group as one batched call. The rows of a group go to the backend as a view of the
pool (no copy: ONNX Runtime reads them in place and the ring write lands in the pool); rows that are not contiguous
are covered by spans with hole rows, computed with a dummy token and then put back exactly (see RowPool.spans),
never gathered. Backends whose state is not host numpy arrays (TensorRT, ONNX Runtime on CUDA) keep one state per
conversation and run a batch's requests one after another (SeparateStates).

Why rows kept here with the `oldest` strategy, and no gathering: measured on the enwik8-base shape (12 layers,
d_model 512, mem_len 512: 24 MiB of memory per conversation, ONNX Runtime CPU, 1 thread, a busy 2-core machine),
one batched decode step of 16 rows took 0.22 s, and gathering those 16 rows into a contiguous batch and writing
them back took 0.92 s more: copying memories costs several steps, so the win is in never copying rows, not in who
numbers the slots. The `direct` strategy's batch slots would give the same views but add limits `oldest` does not
have: every live conversation pins a batch slot, so no more conversations than max_batch can be live per instance
(`oldest` keeps max_candidate_sequences live and batches any max_batch of them), and idle slots below the highest
busy one arrive as null requests to skip. With conversations streaming, most batches are runs of neighbouring rows
either way (rows are handed out lowest first); the load benchmark reports how full the batches are.

Requests: `tokens` [1, Q] int64 (Q <= max_request_tokens) and `out_positions` [1, P] int64 (indices into the
segment) -> `log_probs` [1, P, V] float32. Park and resume: asking for the output `saved_state` returns the
conversation's memory after this request's tokens, as the bytes of an .npz file holding `TxlRuntime.save_state()`'s
arrays (one row, the model's fingerprint, a format version); with END that parks the conversation. A START request
with the input `resume_state` (such bytes) starts the conversation from that memory, refused with an error when the
state belongs to another model. Tokens may be empty ([1, 0]) in a request that only parks or resumes; it gets the
conversation's latest next-token log-probs as `log_probs` [1, 1, V] (NaN if none is known).
Lazy adaptive-softmax decoding (models with cutoffs; names and shapes in protocol.py): a request may ask for
`head_log_probs` instead of `log_probs` (the shortlist's log-probs and one per tail cluster), and a request that
feeds no tokens may name `tail_clusters` to get `tail_log_probs`, those clusters' tokens' log-probs in the
conversation's latest distribution, leaving the memory as it was. Where the model's softmax parts are at hand (the
head and tail graphs `txl-deploy export` writes beside the model, which `triton-repo` copies into the repository;
the backend's `clusters`), a step that asks for the head and not `log_probs` runs the head graph only (the same
memory update), and the conversation keeps that position's hidden vector and head instead of a distribution; a tail
request then runs just the tail graphs it names on that hidden vector. That saves the model's work as well as the
transfer: WikiText-103's 267,735 words are 1 MB of log-probs a token against 80 KB for its head, and its tails 62% of
the bytes a decode step reads. Requests in one batch that ask for `log_probs` run the full graph, those that ask only
for the head the head graph: one call for each kind. A request that asks for `log_probs` after a head-only step
without feeding tokens (a park's answer) gets the full distribution composed from the head and every
tail, the full graph's composition (runtimes.lazy_decode.full_log_probs), and a parked state carries it, so the
saved state's format is the same either way. Without the parts (a model exported without them, a part missing or
refused, a backend without head and tail graphs, e.g. TensorRT or ONNX Runtime with the memory on the GPU) the head
is summed from the full distribution the graph computed and tails are sliced from it: only the transfer is saved;
`initialize` logs which of the two the instance does. How often each graph and each tail ran is counted (`counts`)
and published as Triton custom metrics where the server allows them (`txl_deploy_graph_runs` by graph,
`txl_deploy_tail_runs` by cluster, on the metrics port), and logged at unload.
A bad request gets an error response and changes no memory. Inputs are refused by their shape before the model
allocates anything from them: tokens and out_positions beyond max_request_tokens, a resume_state larger than one
conversation's state; the inputs are then checked, and a resume_state read as untrusted, in model_inputs.py (a module
of the installed txl_deploy, found through PYTHONPATH like the rest: the repository holds this file only).

The model returns log-probs and never samples: its clients choose tokens with the sampler every txl-deploy path
uses (runtimes/sampling/): `TxlTritonClient` conversations, `serve-client`, and `txl-deploy serve --triton`.
"""

import json
import math
import os
import site
import sys
import time
from collections import OrderedDict


def _apply_pythonpath():
    # The stub starts Python in isolated mode: PYTHONPATH is in os.environ but not on sys.path. Apply it here, with
    # site.addsitedir so .pth files (editable installs) work too, ahead of the base interpreter's site-packages.
    before = list(sys.path)
    for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        if entry and os.path.isdir(entry):
            site.addsitedir(entry)
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before


_apply_pythonpath()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

# txl_deploy is found through PYTHONPATH, applied just above.
from txl_deploy.contract.clusters import Clusters  # noqa: E402
from txl_deploy.runtimes import TxlRuntime  # noqa: E402
from txl_deploy.runtimes.lazy_decode import full_log_probs  # noqa: E402
from txl_deploy.runtimes.saved_state import max_archive_bytes  # noqa: E402
from txl_deploy.serving.rows import RowPool, row_store  # noqa: E402
from txl_deploy.serving.triton.model_inputs import (  # noqa: E402
    check_segment,
    check_tail_clusters,
    first_line,
    parked_bytes,
    read_parked,
)
from txl_deploy.serving.triton.protocol import (  # noqa: E402
    HEAD_OUTPUT, RESUME_INPUT, SAVED_OUTPUT, TAIL_INPUT, TAIL_OUTPUT, UNKNOWN_TO_MODEL)

_previous_hook = sys.unraisablehook



def _quiet_dlpack_capsules(unraisable):
    # numpy 2 reports "PyCapsule_GetPointer called with incorrect name" when it frees a DLPack capsule that the
    # stub has consumed (renamed "used_dltensor"): nothing is wrong, the tensor was handed over.
    if isinstance(unraisable.exc_value, ValueError) and "PyCapsule_GetPointer" in str(unraisable.exc_value):
        return
    _previous_hook(unraisable)


sys.unraisablehook = _quiet_dlpack_capsules


def _input(request, name, max_elements=None, what="elements"):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    # DLPack, not as_numpy(): this stub's numpy glue was built for numpy 1 and misreads numpy 2 arrays.
    # A zero-size tensor has no data pointer to hand over: rebuild it from its shape.
    shape = tuple(int(d) for d in tensor.shape())
    if max_elements is not None and math.prod(shape) > max_elements:  # judged by its shape, before any copy
        raise ValueError(f"{name} of shape {list(shape)} is {'larger' if what == 'bytes' else 'longer'} than this "
                         f"server accepts per request ({max_elements:,} {what})")
    if 0 in shape:
        return np.zeros(shape, dtype=np.int64)
    return np.from_dlpack(tensor)


def _output(name, array):
    return pb_utils.Tensor.from_dlpack(name, np.ascontiguousarray(array))


class Conversation:
    """A live conversation: its memory's handle and its latest next-token distribution, kept as the full log-probs
    (`last_log_probs` [V]) or, after a head-only step, as the head graph's outputs at that position (`last_hidden`
    [d_model], `last_head` [shortlist + n]); at most one of the two, none when it is not known."""

    __slots__ = ("corrid", "handle", "used", "last_log_probs", "last_hidden", "last_head")

    def __init__(self, corrid, handle, used):
        self.corrid, self.handle, self.used = corrid, handle, used
        self.last_log_probs = self.last_hidden = self.last_head = None

    def latest(self, log_probs=None, hidden=None, head=None):
        self.last_log_probs, self.last_hidden, self.last_head = log_probs, hidden, head


class _Work:
    __slots__ = ("index", "conv", "tokens", "positions", "want_state", "end", "log_probs", "head", "error",
                 "want_full", "want_head", "tails")

    def __init__(self, index, conv, tokens, positions, want_state, end, want_full=True, want_head=False, tails=None):
        self.index, self.conv, self.tokens, self.positions = index, conv, tokens, positions
        self.want_state, self.end, self.log_probs, self.head, self.error = want_state, end, None, None, None
        self.want_full, self.want_head, self.tails = want_full, want_head, tails


def _log(level, message):
    """The server's log (Triton's python-backend logger); never a reason to fail."""
    try:
        logger = pb_utils.Logger
        log = getattr(logger, "log_warn", None) if level == "warn" else None
        (log or logger.log_info)(message)
    except Exception:
        pass


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        model_file = os.path.join(version_dir, params["model_file"])
        threads = int(params.get("txl_deploy.threads") or 0) or None  # ONNX Runtime intra-op threads
        if model_file.endswith(".onnx"):
            providers = ["cpu"]
            if args.get("model_instance_kind") == "GPU":
                providers = [("cuda", {"device_id": int(args.get("model_instance_device_id", 0))}), "cpu"]
            self.runtime = TxlRuntime.load(model_file, providers=providers, threads=threads)
        else:
            self.runtime = TxlRuntime.load(model_file)  # a TensorRT engine: host threads do not matter
        self.backend = self.runtime.backend
        self.n_token = self.runtime.n_token
        # The adaptive softmax's tail clusters (none for a plain softmax): what head and tail requests refer to.
        self.clusters = Clusters.of(self.runtime.config)
        self.n_clusters = self.clusters.n_clusters if self.clusters is not None else 0
        self.max_request_tokens = int(params.get("max_request_tokens") or self.backend.max_segment)
        # At most max_candidate_sequences conversations are live on one instance at a time (Triton's oldest
        # strategy); more held memories can only belong to sequences Triton has already dropped (idle timeout).
        self.max_sequences = int(config["sequence_batching"]["oldest"]["max_candidate_sequences"])
        idle_us = int(config["sequence_batching"].get("max_sequence_idle_microseconds", 0) or 0)
        self.idle_timeout = idle_us / 1e6 if idle_us > 0 else None
        self.states = row_store(self.backend, self.max_sequences)
        self.max_state_bytes = max_archive_bytes(self.backend, rows=1)  # one conversation's saved state
        self.conversations = OrderedDict()  # corrid -> Conversation, least recently used first
        self.fingerprint = self.backend.fingerprint()
        # Head-only steps and tails on request run the softmax's own graphs where the backend has them (see above).
        self.lazy = self.clusters is not None and getattr(self.backend, "clusters", None) is not None
        self.counts = {"head": 0, "full": 0, "tails": [0] * self.n_clusters}  # rows run through each graph
        self._metrics = self._make_metrics(args.get("model_name", ""), args.get("model_version", ""))
        if self.lazy:
            _log("info", "txl-deploy: head requests run the head graph only, tail requests their tail graphs")
        elif self.clusters is not None:
            why = getattr(self.backend, "parts_error", None)
            why = first_line(why) if why is not None else f"none listed, or the {self.backend.name} backend runs none"
            _log("warn", f"txl-deploy: the model's softmax parts are not at hand ({why}): head and tail requests "
                         "are answered from full distributions")

    def _make_metrics(self, model, version):
        """Triton custom metrics counting the rows each graph ran for, or None where this server's Python backend
        has none or does not allow them (--allow-metrics=false): `counts` keeps them either way."""
        family = getattr(pb_utils, "MetricFamily", None)
        if family is None:
            return None
        labels = {"model": str(model), "version": str(version)}
        try:
            graphs = family(name="txl_deploy_graph_runs", description="rows of requests run through the model's "
                            "full graph or its adaptive softmax's head graph", kind=family.COUNTER)
            tails = family(name="txl_deploy_tail_runs", description="rows the adaptive softmax's tail graphs ran "
                           "for, by tail cluster", kind=family.COUNTER)
            # the families stay referenced: a metric of a family that was freed refuses to count
            return {"families": (graphs, tails), "full": graphs.Metric(labels={**labels, "graph": "full"}),
                    "head": graphs.Metric(labels={**labels, "graph": "head"}),
                    "tails": [tails.Metric(labels={**labels, "cluster": str(i)})
                              for i in range(1, self.n_clusters + 1)]}
        except Exception as e:  # metrics are a report, never a reason not to serve
            _log("info", f"txl-deploy: no custom metrics ({first_line(e)}); counts are logged at unload")
            return None

    def _count(self, graph, rows, cluster=None):
        if graph == "tails":
            self.counts["tails"][cluster - 1] += rows
        else:
            self.counts[graph] += rows
        if self._metrics is not None:
            try:
                (self._metrics["tails"][cluster - 1] if graph == "tails" else self._metrics[graph]).increment(rows)
            except Exception as e:
                _log("warn", f"txl-deploy: custom metrics stopped ({first_line(e)})")
                self._metrics = None

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _forget(self, corrid):
        conv = self.conversations.pop(corrid, None)
        if conv is not None:
            self.states.release(conv.handle)

    def _forget_idle(self, now):
        if self.idle_timeout is None:
            return
        for corrid in [c for c, conv in self.conversations.items() if now - conv.used > self.idle_timeout]:
            self._forget(corrid)

    def _start(self, corrid, now, resume):
        arrays, last = (read_parked(resume, self.backend) if resume is not None else (None, None))
        self._forget(corrid)
        while len(self.conversations) >= self.max_sequences:
            self._forget(next(iter(self.conversations)))  # Triton has already dropped it (see initialize)
        conv = Conversation(corrid, self.states.start(), now)
        if arrays is not None:
            self.states.load(conv.handle, arrays)
            conv.last_log_probs = last
        self.conversations[corrid] = conv
        return conv

    # -- park / resume (model_inputs.read_parked / parked_bytes) ------------------------------------------------
    def _saved_state(self, conv):
        last = self._latest_full(conv)  # after a head-only step, composed from the head and every tail
        return parked_bytes(self.backend, self.states.save(conv.handle), last, conv.corrid)

    # -- requests ---------------------------------------------------------------------------------------------
    def execute(self, requests):
        now = time.monotonic()
        self._forget_idle(now)
        responses = [None] * len(requests)
        waves = [[]]  # the batcher sends one request per conversation; a second one would wait for the first
        seen = [set()]
        for i, request in enumerate(requests):
            work = self._accept(i, request, now, responses)
            if work is None:
                continue
            w = next((k for k, s in enumerate(seen) if work.conv.corrid not in s), None)
            if w is None:
                waves.append([])
                seen.append(set())
                w = len(waves) - 1
            waves[w].append(work)
            seen[w].add(work.conv.corrid)
        for wave in waves:
            self._run_wave(wave)
            for work in wave:
                responses[work.index] = self._respond(work)
        return responses

    def _accept(self, i, request, now, responses):
        """Check one request and find (or start) its conversation; on error its response is set here."""
        corrid = end = None
        try:
            corrid = int(_input(request, "CORRID").reshape(-1)[0])
            start = bool(_input(request, "START").reshape(-1)[0])
            end = bool(_input(request, "END").reshape(-1)[0])
            resume = _input(request, RESUME_INPUT, self.max_state_bytes, "bytes")
            wanted = request.requested_output_names()
            want_state = SAVED_OUTPUT in wanted
            want_head = HEAD_OUTPUT in wanted
            tails = check_tail_clusters(_input(request, TAIL_INPUT, max(self.n_clusters, 1), "clusters"),
                                        self.n_clusters if self.clusters is not None else None)
            if want_head and self.clusters is None:
                raise ValueError(f"{HEAD_OUTPUT}: this model has no adaptive softmax (a plain softmax): ask for "
                                 "log_probs")
            want_full = "log_probs" in wanted or not (want_head or tails is not None)
            tokens = _input(request, "tokens", self.max_request_tokens, "tokens")
            positions = _input(request, "out_positions", self.max_request_tokens, "positions")
            tokens, positions = check_segment(tokens, positions, self.n_token, self.max_request_tokens,
                                              state_only=resume is not None or want_state or tails is not None)
            if resume is not None and not start:
                raise ValueError(f"{RESUME_INPUT} starts a conversation: send it with sequence_start")
            if start:
                conv = self._start(corrid, now, resume)
            elif corrid in self.conversations:
                conv = self.conversations[corrid]
                self.conversations.move_to_end(corrid)
                conv.used = now
            else:
                raise ValueError(f"conversation {corrid} {UNKNOWN_TO_MODEL} (it ended, idled out, "
                                 "or the server restarted): start a new sequence")
            return _Work(i, conv, tokens, positions, want_state, end, want_full, want_head, tails)
        except Exception as e:  # a bad request must not take the instance (and its other conversations) down
            responses[i] = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"txl-deploy: {first_line(e)}"))
            if end and corrid is not None:
                self._forget(corrid)
            return None

    def _run_wave(self, wave):
        groups = {}  # (segment length, head graph or full) -> its requests: one batched call each
        for work in wave:
            if work.tokens.shape[1]:
                head = self.lazy and work.want_head and not work.want_full
                groups.setdefault((work.tokens.shape[1], head), []).append(work)
        for (_, head), group in groups.items():
            group.sort(key=lambda w: w.conv.handle if isinstance(w.conv.handle, int) else 0)
            widths = {w.positions.shape[1] for w in group}
            p_max = max(widths)
            tokens = np.concatenate([w.tokens for w in group])
            if len(widths) == 1:  # the usual case (decode: one position each)
                positions = np.concatenate([w.positions for w in group])
            else:  # rows with fewer out_positions repeat their last one; the extra columns are sliced off below
                positions = np.stack([np.pad(w.positions[0], (0, p_max - w.positions.shape[1]), mode="edge")
                                      for w in group])
            try:
                result = self.states.run([w.conv.handle for w in group], tokens, positions, head=head)
            except Exception as e:  # the backend commits nothing on failure: every memory is as it was
                for w in group:
                    w.error = e
                continue
            self._count("head" if head else "full", len(group))
            q = tokens.shape[1]
            for j, w in enumerate(group):
                p = w.positions.shape[1]
                known = int(w.positions[0, -1]) == q - 1  # the next-token distribution is the last position's
                if head:
                    hidden, head_lp = result
                    w.head = head_lp[j:j + 1, :p]
                    w.conv.latest(*((None, np.array(hidden[j, p - 1]), np.array(head_lp[j, p - 1])) if known
                                    else ()))
                else:
                    w.log_probs = result[j:j + 1, :p]
                    w.conv.latest(np.array(result[j, p - 1]) if known else None)

    def _respond(self, work):
        try:
            if work.error is not None:
                raise work.error
            log_probs, head = work.log_probs, work.head
            if log_probs is None and head is None:
                # A park/resume request without tokens answers with the conversation's latest next-token
                # log-probs (NaN where none is known): never a zero-size tensor, which the stub cannot hand over.
                if work.want_full or work.conv.last_head is None:
                    last = self._latest_full(work.conv)
                    log_probs = (np.full((1, 1, self.n_token), np.nan, np.float32) if last is None
                                 else last.reshape(1, 1, -1))
                else:
                    head = work.conv.last_head.reshape(1, 1, -1)
            outputs = []
            if work.want_full:
                outputs.append(_output("log_probs", log_probs.astype(np.float32, copy=False)))
            if work.want_head:
                outputs.append(_output(HEAD_OUTPUT, self._head(log_probs) if head is None else head))
            if work.tails is not None:
                outputs.append(_output(TAIL_OUTPUT, self._tails(work.conv, work.tails)))
            if work.want_state:
                outputs.append(_output(SAVED_OUTPUT, self._saved_state(work.conv)))
            response = pb_utils.InferenceResponse(output_tensors=outputs)
        except Exception as e:
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"txl-deploy: {first_line(e)}"))
        if work.end:
            self._forget(work.conv.corrid)
        return response

    # -- lazy adaptive-softmax decoding (protocol.HEAD_OUTPUT, TAIL_INPUT, TAIL_OUTPUT) ---------------------------
    def _head(self, log_probs):
        """[1, P, V] log-probs -> [1, P, shortlist + n] (protocol.HEAD_OUTPUT): `Clusters.head_from_full`, each
        cluster's log-prob >= every one of its tokens', so a sampler's bound holds."""
        return self.clusters.head_from_full(log_probs)

    def _tails(self, conv, ids):
        """The log-probs of clusters `ids`' tokens in the conversation's latest next-token distribution [1, N]:
        after a head-only step, each tail graph run on that position's hidden vector; else sliced from the full
        distribution."""
        if conv.last_hidden is not None:
            hidden, head = conv.last_hidden[None], conv.last_head[None]
            parts = []
            for i in ids:
                i = int(i)
                parts.append(self.backend.run_tail(i, hidden, head[:, self.clusters.head_column(i)])[0])
                self._count("tails", 1, i)
            return np.concatenate(parts).astype(np.float32, copy=False)[None]
        last = conv.last_log_probs
        if last is None:
            raise ValueError(f"{TAIL_INPUT}: conversation {conv.corrid} has no next-token distribution yet (feed "
                             "tokens, with the last position among out_positions)")
        flat = np.asarray(last, dtype=np.float32).reshape(-1)
        return np.concatenate([flat[slice(*self.clusters.bounds[i - 1])] for i in ids])[None]

    def _latest_full(self, conv):
        """The conversation's latest next-token log-probs [V] (None when not known). After a head-only step they are
        composed from the head and every tail (the full graph's composition) and kept: asked once, computed once."""
        if conv.last_hidden is not None:
            full = full_log_probs(self.backend, conv.last_hidden[None], conv.last_head[None])[0]
            for i in range(1, self.n_clusters + 1):
                self._count("tails", 1, i)
            conv.latest(np.array(full))
        return conv.last_log_probs

    def finalize(self):
        if isinstance(self.states, RowPool):
            _log("info", f"txl-deploy: batched calls {self.states.viewed} without and {self.states.with_holes} with "
                         "hole rows")
        _log("info", f"txl-deploy: rows run through the full graph {self.counts['full']}, the head graph "
                     f"{self.counts['head']}, tail clusters 1..{self.n_clusters} {self.counts['tails']}")
        self.conversations.clear()
        self.runtime.close()
