"""The backend contract: what ONNX Runtime, TensorRT and the PyTorch backends implement for `TxlRuntime`.

A backend runs already-valid arrays (the runtime checks every input once, before a backend sees it) and keeps its
state opaque to the runtime. `check_state` is the one validation of a saved state that every backend applies when
it rebuilds a state from arrays.
"""

from __future__ import annotations

import abc

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.errors import InputError


class Backend(abc.ABC):
    """What a backend implements. `state` is opaque to the runtime."""

    name = "?"
    config = None  # TxlConfig
    vocab = None  # Vocab or None
    mem_len = 0
    max_segment = 512
    precision = "fp32"
    threads = None  # CPU threads the backend was opened with (None: its library's default)
    # The adaptive softmax's layout (contract.clusters.Clusters) when this backend can
    # compute the head and each tail separately (run_head, run_tail); None: only full distributions (run).
    clusters = None

    @abc.abstractmethod
    def fingerprint(self) -> str:
        """Identifies the model and state layout: a saved state loads only where the fingerprint matches."""

    @abc.abstractmethod
    def new_state(self, batch: int):
        """An empty memory for `batch` independent streams."""

    @abc.abstractmethod
    def state_batch(self, state) -> int:
        """Rows of `state`."""

    @abc.abstractmethod
    def run(self, state, tokens: np.ndarray, out_positions: np.ndarray) -> np.ndarray:
        """tokens [B, Q] int64 (Q <= max_segment), out_positions [B, P] int64 -> log_probs [B, P, V] float32.

        Advances `state` by Q tokens, only once the computation has succeeded."""

    def run_fixed(self, state, tokens: np.ndarray, out_positions: np.ndarray) -> np.ndarray:
        """`run` that leaves `state` as it was, so the same call can be repeated (other positions' log-probs).
        Backends that cannot raise NotImplementedError."""
        raise NotImplementedError(f"the {self.name} backend always advances its memory")

    def run_head(self, state, tokens: np.ndarray, out_positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`run` that stops at the adaptive softmax's head: (hidden [B, P, d_model], head_log_probs
        [B, P, shortlist + n_clusters]) float32, advancing `state` exactly as `run` does. Only where `clusters`
        is set."""
        raise NotImplementedError(f"the {self.name} backend computes full distributions only")

    def run_tail(self, i: int, hidden: np.ndarray, head_log_prob: np.ndarray) -> np.ndarray:
        """Tail cluster i (1..n_clusters) on hidden [N, d_model] and its head column [N]: the full log-probs
        [N, hi_i - lo_i] of the cluster's tokens (log p_head(i) + log p_i(t | i)). Only where `clusters` is set."""
        raise NotImplementedError(f"the {self.name} backend computes full distributions only")

    @abc.abstractmethod
    def reset_rows(self, state, rows: np.ndarray):
        """Empty the memory of these rows only."""

    def select_rows(self, state, index: np.ndarray):
        """A state whose row r is `state`'s row index[r] (index: valid row numbers [N], repeats allowed): a fork
        copies one row's memory into several, a beam search reorders its rows. `state` may be reused (in place
        where N is its batch) and must not be used after. This default goes through the host arrays."""
        arrays = self.state_arrays(state)
        return self.state_from_arrays({k: v[index] for k, v in arrays.items()}, copy=False)

    def copy_rows(self, state, src: np.ndarray, dst: np.ndarray):
        """Rows dst[i] of `state` take what rows src[i] hold (dst distinct; the other rows keep theirs), in place:
        a server forks a session into free rows of its pool. Returns the state (this default selects every row)."""
        index = np.arange(self.state_batch(state))
        index[dst] = src
        return self.select_rows(state, index)

    @abc.abstractmethod
    def state_arrays(self, state) -> dict[str, np.ndarray]:
        """The state as host numpy arrays (for save_state)."""

    @abc.abstractmethod
    def state_from_arrays(self, arrays: dict[str, np.ndarray], copy: bool = True):
        """A state from save_state's arrays, validated (see check_state). copy=False: the arrays are the caller's
        to give away (freshly read from a file), and may become the state itself."""

    def state_layout(self, batch: int) -> dict[str, tuple[tuple, np.dtype]]:
        """Every state tensor's (shape, dtype) for `batch` rows, in save_state's order: what a saved state must
        hold, known before any of its data is read (runtimes.saved_state)."""
        raise NotImplementedError(f"the {self.name} backend does not describe its state")

    def checked_arrays(self, arrays: dict, copy: bool = True) -> tuple[int, dict]:
        """save_state's arrays checked against `state_layout` (see check_state): (batch, the arrays)."""
        layout = self.state_layout(1)
        return check_state(arrays, layout, lambda n, b: self.state_layout(b)[n][0], lambda n: layout[n][1],
                           copy=copy)

    def close(self):
        pass


def contract_layout(spec, batch: int, float_dtype) -> dict[str, tuple[tuple, np.dtype]]:
    """The graph contract's state tensors (`spec.state_inputs()`) for `batch` rows: name -> (shape, dtype), the
    floats in `float_dtype`. The state_layout of every backend that runs the contract's graph."""
    return {s.name: (s.shape_for(batch), np.dtype(np.int64 if s.dtype == "int64" else float_dtype))
            for s in spec.state_inputs()}


def check_state(arrays: dict, names, shape_of, dtype_of, what: str = "model", copy: bool = True) -> tuple[int, dict]:
    """Validate a saved state for a backend: the same tensor names, `mem_count` of shape [batch], and every tensor
    of shape `shape_of(name, batch)` and dtype `dtype_of(name)`. Returns (batch, private copies of the arrays, or
    with copy=False the arrays themselves where they are already contiguous)."""
    names = list(names)
    if set(arrays) != set(names):
        raise InputError("this state does not belong to this model (its tensors differ: "
                         f"{sorted(set(arrays) ^ set(names))[:3]})")
    count = np.asarray(arrays[io_spec.MEM_COUNT])
    if count.ndim != 1:
        raise InputError(f"mem_count must be [batch], got shape {count.shape}")
    batch = count.shape[0]
    out = {}
    for name in names:
        a, want, dtype = np.asarray(arrays[name]), tuple(shape_of(name, batch)), np.dtype(dtype_of(name))
        if a.shape != want or a.dtype != dtype:
            raise InputError(f"state tensor {name} has shape {a.shape} {a.dtype}, this {what} needs {want} "
                             f"{dtype.name}")
        out[name] = np.array(a, copy=True) if copy else np.ascontiguousarray(a)
    return batch, out
