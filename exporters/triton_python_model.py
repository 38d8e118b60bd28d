"""Triton Python-backend model serving a txl-deploy model with `TxlRuntime`, one memory per conversation.

`txl-deploy triton-repo --backend python` copies this file to `<repo>/<model>/1/model.py`; it runs inside Triton's
Python-backend stub, never inside txl-deploy itself. Every conversation is a Triton sequence (sequence_id =
CORRID): START gives it a fresh memory, each request continues it, END forgets it. The Python backend has no
implicit state, so this model keeps the memories itself, keyed by CORRID: a `TxlRuntime` per conversation, all
sharing one loaded model (one ONNX Runtime session or TensorRT engine per model instance).

Requests: `tokens` [1, Q] int64 (Q <= max_request_tokens) and `out_positions` [1, P] int64 (indices into the
segment); response: `log_probs` [1, P, V] float32. A bad request gets an error response and changes no memory.
"""

import json
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

_previous_hook = sys.unraisablehook


def _quiet_dlpack_capsules(unraisable):
    # numpy 2 reports "PyCapsule_GetPointer called with incorrect name" when it frees a DLPack capsule that the
    # stub has consumed (renamed "used_dltensor"): nothing is wrong, the tensor was handed over.
    if isinstance(unraisable.exc_value, ValueError) and "PyCapsule_GetPointer" in str(unraisable.exc_value):
        return
    _previous_hook(unraisable)


sys.unraisablehook = _quiet_dlpack_capsules


def _input(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    # DLPack, not as_numpy(): this stub's numpy glue was built for numpy 1 and misreads numpy 2 arrays.
    return np.from_dlpack(tensor)


def _output(name, array):
    return pb_utils.Tensor.from_dlpack(name, np.ascontiguousarray(array))


class TritonPythonModel:
    def initialize(self, args):
        from txl_deploy.runtimes import TxlRuntime

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        model_file = os.path.join(version_dir, params["model_file"])
        providers = None
        if args.get("model_instance_kind") == "GPU":
            providers = [("cuda", {"device_id": int(args.get("model_instance_device_id", 0))}), "cpu"]
        elif model_file.endswith(".onnx"):
            providers = ["cpu"]
        self.shared = TxlRuntime.load(model_file, providers=providers)  # providers: ONNX Runtime only
        self.n_token = self.shared.n_token
        self.max_request_tokens = int(params.get("max_request_tokens") or self.shared.backend.max_segment)
        # At most max_candidate_sequences conversations are live on one instance at a time (Triton's oldest
        # strategy); more held memories can only belong to sequences Triton has already dropped (idle timeout).
        self.max_sequences = int(config["sequence_batching"]["oldest"]["max_candidate_sequences"])
        idle_us = int(config["sequence_batching"].get("max_sequence_idle_microseconds", 0) or 0)
        self.idle_timeout = idle_us / 1e6 if idle_us > 0 else None
        self.conversations = OrderedDict()  # corrid -> (TxlRuntime, last use), least recently used first
        self.log = pb_utils.Logger

    # -- bookkeeping ------------------------------------------------------------------------------------------
    def _forget_idle(self, now):
        if self.idle_timeout is None:
            return
        for corrid in [c for c, (_, used) in self.conversations.items() if now - used > self.idle_timeout]:
            del self.conversations[corrid]

    def _start(self, corrid, now):
        from txl_deploy.runtimes import TxlRuntime

        self.conversations.pop(corrid, None)
        while len(self.conversations) >= self.max_sequences:
            self.conversations.popitem(last=False)  # Triton has already dropped it (see initialize)
        # A TxlRuntime over the shared backend: its own memory, the instance's loaded model.
        rt = TxlRuntime(self.shared.backend)
        self.conversations[corrid] = (rt, now)
        return rt

    # -- requests ---------------------------------------------------------------------------------------------
    def execute(self, requests):
        now = time.monotonic()
        self._forget_idle(now)
        return [self._one(request, now) for request in requests]

    def _one(self, request, now):
        corrid = start = end = None
        try:
            corrid = int(_input(request, "CORRID").reshape(-1)[0])
            start = bool(_input(request, "START").reshape(-1)[0])
            end = bool(_input(request, "END").reshape(-1)[0])
            if start:
                rt = self._start(corrid, now)
            elif corrid in self.conversations:
                rt = self.conversations[corrid][0]
                self.conversations.move_to_end(corrid)
                self.conversations[corrid] = (rt, now)
            else:
                raise ValueError(f"conversation {corrid} is unknown to this model instance (it ended, idled out, "
                                 "or the server restarted): start a new sequence")
            tokens, positions = self._check(_input(request, "tokens"), _input(request, "out_positions"))
            if positions.shape[1] == 1 and int(positions[0, 0]) == tokens.shape[1] - 1:
                log_probs = rt.prefill(tokens)[:, None, :]  # the decode case: never builds [Q, V]
            else:
                log_probs = rt.step(tokens)[:, positions[0], :]
            response = pb_utils.InferenceResponse(output_tensors=[_output("log_probs", log_probs.astype(np.float32))])
        except Exception as e:  # a bad request must not take the instance (and its other conversations) down
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            response = pb_utils.InferenceResponse(error=pb_utils.TritonError(f"txl-deploy: {message}"))
        if end and corrid is not None:
            self.conversations.pop(corrid, None)
        return response

    def _check(self, tokens, positions):
        if tokens is None or positions is None:
            raise ValueError("requests need the inputs tokens [1, Q] and out_positions [1, P]")
        if tokens.ndim != 2 or tokens.shape[0] != 1:
            raise ValueError(f"tokens must be [1, Q] (one conversation per request), got shape {list(tokens.shape)}")
        q = tokens.shape[1]
        if q < 1:
            raise ValueError("tokens is empty")
        if q > self.max_request_tokens:
            raise ValueError(f"segment of {q} tokens is longer than this server accepts per request "
                             f"({self.max_request_tokens}); send long prompts in pieces")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.n_token:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.n_token})")
        if positions.ndim != 2 or positions.shape[0] != 1 or positions.shape[1] < 1:
            raise ValueError(f"out_positions must be [1, P] with P >= 1, got shape {list(positions.shape)}")
        if int(positions.min()) < 0 or int(positions.max()) >= q:
            raise ValueError(f"out_positions must index the segment [0, {q}), got {positions.reshape(-1).tolist()[:8]}")
        return np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(positions, dtype=np.int64)

    def finalize(self):
        self.conversations.clear()
        self.shared.close()
