"""Where the memories of many streams live: the rows of ONE batched backend state, run a subset at a time.

Shared by the Triton Python model (serving/triton/python_model.py: a conversation is a row) and the HTTP server
(serving/http/scheduler.py: a running request or a session is a row).

A backend call advances every row it is given by the same segment length, so a server whose streams are at
different points (one feeding a prompt, others decoding) cannot hand the whole batch to one call. `RowPool` runs any
subset of rows: contiguous runs go to the backend as views of the pool (no copy: ONNX Runtime reads them in place
and the ring write lands in the pool), and runs separated by small gaps are merged into one call whose hole rows
are computed with a dummy token and then put back exactly (`spans`). Never gathering rows is the point: measured on
the enwik8-base shape (24 MiB of memory per stream), gathering 16 rows and writing them back cost several decode
steps (see python_model.py).

`SeparateStates` is the fallback for backends whose state is not host numpy arrays (TensorRT engines, ONNX Runtime
on CUDA, the PyTorch backends): one state per stream, run one after another. `row_store` picks one for a backend.

Both account for what they hand out (`used`, `accounted()`): a row is used from `start` to `release`, released once,
and never handed out beyond the capacity (`RowsExhausted`), so a caller that loses track of a row finds out. A call
over several spans or states that fails part way raises `PartialRun`, which says which rows advanced before it.
"""

from __future__ import annotations

import heapq

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.ring import segment_slots


class RowsExhausted(RuntimeError):
    """Every row is in use: the caller handed out more streams than it made room for (its bug, not a user's)."""


class PartialRun(Exception):
    """A call failed after some of its spans (or separate states) had run: those rows advanced, the others are as
    they were. `committed`: the indices (into the rows given) that advanced; the failure is the __cause__."""

    def __init__(self, committed: list[int]):
        super().__init__(f"failed after {len(committed)} rows had advanced")
        self.committed = committed


def row_store(backend, capacity: int):
    """A RowPool when the backend keeps its state as host numpy arrays, else SeparateStates."""
    probe = backend.new_state(1)
    batched = isinstance(probe, dict) and all(isinstance(v, np.ndarray) for v in probe.values())
    del probe
    return (RowPool if batched else SeparateStates)(backend, capacity)


def row_bytes(backend) -> int:
    """Bytes of one stream's memory (every state tensor of one row)."""
    return sum(int(np.asarray(v).nbytes) for v in backend.state_arrays(backend.new_state(1)).values())


class RowPool:
    """The memories of up to `capacity` conversations as the rows of one batched state (dict of numpy arrays, as
    the ONNX Runtime CPU backend keeps it). Rows are handed out lowest first, so conversations that start together
    hold neighbouring rows and their batches are contiguous views."""

    def __init__(self, backend, capacity):
        self.backend = backend
        self.size = int(capacity)
        self.state = backend.new_state(capacity)  # np.zeros: pages are only touched once a row is used
        self.free = list(range(capacity))
        heapq.heapify(self.free)
        self.used: set[int] = set()
        self.with_holes = self.viewed = 0  # spans run with / without hole rows (logged at finalize)
        self.incremental = getattr(getattr(backend, "spec", None), "state", "full") == "incremental"

    def start(self):
        if not self.free:
            raise RowsExhausted(f"all {self.size} memory rows are in use")
        row = self.free[0]
        self.backend.reset_rows(self.state, np.array([row], dtype=np.int64))
        heapq.heappop(self.free)  # only once the row is empty: a failed reset hands nothing out
        self.used.add(row)
        return row

    def release(self, row):
        if row not in self.used:
            raise ValueError(f"row {row} is not in use: released twice, or never handed out")
        self.used.remove(row)
        heapq.heappush(self.free, row)

    def accounted(self) -> bool:
        """Every row is either free or used, once."""
        free = set(self.free)
        return (len(free) == len(self.free) and not free & self.used and len(free) + len(self.used) == self.size
                and free | self.used == set(range(self.size)))

    def load(self, row, arrays):
        for name, value in arrays.items():
            self.state[name][row] = value[0]

    def save(self, row):
        return {name: np.array(value[row:row + 1]) for name, value in self.state.items()}

    def copy(self, row, rows):
        """Rows `rows` (in use) take what `row` holds: a fork, only those rows written (Backend.copy_rows)."""
        dst = np.asarray(rows, dtype=np.int64).reshape(-1)
        self.state = self.backend.copy_rows(self.state, np.full(dst.size, row, dtype=np.int64), dst)

    def spans(self, rows):
        """Contiguous row ranges [lo, hi) covering `rows` (sorted, unique) and which of them each holds. Runs of
        rows merge across a gap while the gap rows are no more than the member rows: a hole costs one wasted row
        of compute, a separate call re-reads every weight (and a gather would copy whole memories)."""
        spans = []
        for i, row in enumerate(rows):
            if spans and row == spans[-1][1]:
                spans[-1][1] += 1
                spans[-1][2].append(i)
                continue
            if spans:
                lo, hi, members = spans[-1]
                if (row + 1 - lo) - (len(members) + 1) <= len(members) + 1:
                    spans[-1][1] = row + 1
                    members.append(i)
                    continue
            spans.append([row, row + 1, [i]])
        return spans

    def run(self, rows, tokens, positions, head: bool = False):
        """One batched call per span of rows (see spans); rows must be sorted. Rows inside a span that are not in
        `rows` (holes) are computed with token 0 and then put back exactly as they were. head=True: the backend's
        `run_head` (same memory update), returning (hidden, head log-probs) instead of the log-probs."""
        rows = np.asarray(rows, dtype=np.int64)
        out = [None] * rows.size
        committed = []
        for lo, hi, members in self.spans(rows):
            try:
                self._run_span(rows, tokens, positions, lo, hi, members, out, head)
            except Exception as e:
                if not committed:
                    raise  # the backend commits nothing on failure: every row is as it was
                raise PartialRun(committed) from e
            committed += members
        return _stacked(out, head)

    def _run_span(self, rows, tokens, positions, lo, hi, members, out, head=False):
        """One span's call; its members' log-probs (or (hidden, head) pairs) go into `out`."""
        mine = rows[members]
        n = hi - lo
        if n == len(members):
            tok, pos = tokens[members], positions[members]
            holes = ()
            self.viewed += 1
        else:
            tok = np.zeros((n, tokens.shape[1]), np.int64)
            pos = np.zeros((n, positions.shape[1]), np.int64)
            tok[mine - lo], pos[mine - lo] = tokens[members], positions[members]
            holes = np.setdiff1d(np.arange(lo, hi), mine)
            self.with_holes += 1
        sub = {name: value[lo:hi] for name, value in self.state.items()}  # views: no copy
        before = dict(sub)
        undo = self._keep(holes, tokens.shape[1]) if len(holes) and self.incremental else None
        result = self.backend.run_head(sub, tok, pos) if head else self.backend.run(sub, tok, pos)
        for name, value in sub.items():
            if value is not before[name]:  # a full-state graph returns new arrays: take the members' rows
                self.state[name][mine] = value[mine - lo]
        if undo is not None:
            self._restore(undo)
        for j, m in enumerate(members):
            out[m] = tuple(r[mine[j] - lo] for r in result) if head else result[mine[j] - lo]

    def _keep(self, holes, q):
        """What the ring write of a q-token segment will overwrite in the hole rows (the backend writes rows in
        place: see contract.ring.write_segment), so it can be put back."""
        m = self.backend.spec.mem_len
        kept = []
        count = self.state[io_spec.MEM_COUNT]
        for h in holes:
            slots = segment_slots(int(count[h]), q, m)
            layers = [(self.state[io_spec.mem_k(i)][h][..., slots].copy(),
                       self.state[io_spec.mem_v(i)][h][:, slots].copy()) for i in range(self.backend.spec.n_layer)]
            kept.append((h, int(count[h]), slots, layers))
        return kept

    def _restore(self, kept):
        for h, count, slots, layers in kept:
            for i, (k, v) in enumerate(layers):
                self.state[io_spec.mem_k(i)][h][..., slots] = k
                self.state[io_spec.mem_v(i)][h][:, slots] = v
            self.state[io_spec.MEM_COUNT][h] = count


class SeparateStates:
    """One state per conversation, run one after another: for backends whose state is not host numpy arrays
    (TensorRT engines, ONNX Runtime on CUDA keep it on the device, where a gather would cost a device copy)."""

    def __init__(self, backend, capacity):
        self.backend = backend
        self.size = int(capacity)
        self._used: dict[int, list] = {}  # id(handle) -> handle

    @property
    def used(self) -> list:
        return list(self._used.values())

    def start(self):
        if len(self._used) >= self.size:
            raise RowsExhausted(f"all {self.size} memories are in use")
        handle = [self.backend.new_state(1)]  # a list: the handle stays the same object when the state is replaced
        self._used[id(handle)] = handle
        return handle

    def release(self, handle):
        if self._used.pop(id(handle), None) is None:
            raise ValueError("this memory is not in use: released twice, or never handed out")
        handle[0] = None

    def accounted(self) -> bool:
        return len(self._used) <= self.size and all(h[0] is not None for h in self._used.values())

    def load(self, handle, arrays):
        handle[0] = self.backend.state_from_arrays(arrays, copy=False)  # arrays just read from the request

    def save(self, handle):
        return {k: np.array(v) for k, v in self.backend.state_arrays(handle[0]).items()}

    def copy(self, handle, handles):
        """The memories `handles` (in use) take copies of what `handle` holds: a fork."""
        for h in handles:
            self.load(h, self.save(handle))

    def run(self, handles, tokens, positions, head: bool = False):
        out = []
        call = self.backend.run_head if head else self.backend.run
        for j, h in enumerate(handles):
            try:
                result = call(h[0], tokens[j:j + 1], positions[j:j + 1])
            except Exception as e:
                if not out:
                    raise
                raise PartialRun(list(range(len(out)))) from e
            out.append(tuple(r[0] for r in result) if head else result[0])
        return _stacked(out, head)


def _stacked(out: list, head: bool):
    """The rows' results as one batch: log-probs [B, P, V], or with head, (hidden [B, P, d], head [B, P, H])."""
    if head:
        return tuple(np.stack(parts) for parts in zip(*out))
    return np.stack(out)
