"""The base of backends whose memory lives in host ring buffers: the graph contract's state, written by the host.

A graph with the incremental layout (`io_spec`) returns only a segment's keys and values; the memory is a dict of
arrays shaped as `contract_layout` says, and `contract.ring.write_segment` puts a segment into its ring slots once
the call has succeeded (a failed call leaves the memory as it was). ONNX Runtime on the CPU, ExecuTorch, OpenVINO
and torch-fast differ only in how they run the graph, the `_execute` hook; the state methods and the commit are
here. torch-fast keeps the same arrays as torch tensors (`_adopt` and `_host` convert).
"""

from __future__ import annotations

import abc
import functools

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.ring import initial_mem_count, write_segment
from txl_deploy.errors import InputError
from txl_deploy.runtimes.backend import Backend, contract_layout


class HostRingBackend(Backend):
    """State: {name: array} in io_spec's order (mem_k.0, mem_v.0, ..., mem_count), `spec` the graph's contract."""

    spec = None  # io_spec.GraphSpec, set by the subclass
    float_dtype = np.float32  # of the memory's keys and values
    max_batch = None  # rows one call takes, where the program was built for a bound (None: any)

    @abc.abstractmethod
    def _execute(self, state, tokens, out_positions, advance: bool, **how):
        """Run the graph on `state` without changing it: (what `run` returns, this segment's new entries in
        io_spec's order, new_k.0, new_v.0, ...). advance=False: the entries are not needed (may be None)."""

    # -- state --------------------------------------------------------------------------------------------------
    def state_layout(self, batch):
        return contract_layout(self.spec, batch, self.float_dtype)

    def new_state(self, batch: int):
        self._check_batch(batch)
        arrays = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.state_layout(batch).items()}
        arrays[io_spec.MEM_COUNT][:] = initial_mem_count(self.config, self.mem_len)
        return self._adopt(arrays)

    def state_batch(self, state) -> int:
        return state[io_spec.MEM_COUNT].shape[0]

    def state_arrays(self, state) -> dict:
        return self._host(state)

    def state_from_arrays(self, arrays, copy=True):
        batch, out = self.checked_arrays(arrays, copy)
        self._check_batch(batch)
        return self._adopt(out)

    def reset_rows(self, state, rows):
        for a in state.values():
            a[rows] = 0  # count 0 masks every slot; zeroed buffers keep 0 * stale-inf from turning into NaN
        state[io_spec.MEM_COUNT][rows] = initial_mem_count(self.config, self.mem_len)  # REMI: attended zeros

    def select_rows(self, state, index):
        if len(index) == self.state_batch(state):  # a reorder: the same buffers, rewritten in place
            for a in state.values():
                a[:] = a[self._index(index)]  # gathered into a temporary first, so rows may swap
            return state
        self._check_batch(len(index))
        return {k: a[self._index(index)] for k, a in state.items()}  # new buffers of the new batch

    def copy_rows(self, state, src, dst):
        for a in state.values():
            a[self._index(dst)] = a[self._index(src)]  # only these rows move; src is gathered before dst is written
        return state

    def _index(self, index: np.ndarray):
        """Row numbers as the state's arrays take them."""
        return index

    def _adopt(self, arrays: dict):
        """The state holding these checked host arrays (they are the backend's to keep)."""
        return arrays

    def _host(self, state) -> dict:
        """The state as host numpy arrays."""
        return dict(state)

    def _check_batch(self, batch: int):
        if self.max_batch is not None and batch > self.max_batch:
            raise InputError(f"{getattr(self, 'path', self.name)} was exported for batches of at most "
                             f"{self.max_batch} rows, got {batch}")

    # -- compute ------------------------------------------------------------------------------------------------
    def run(self, state, tokens, out_positions):
        return self._run(state, tokens, out_positions, advance=True)

    def run_fixed(self, state, tokens, out_positions):
        return self._run(state, tokens, out_positions, advance=False)

    def _run(self, state, tokens, out_positions, advance: bool, **how):
        result, new_entries = self._execute(state, tokens, out_positions, advance, **how)
        if advance:  # only now that the call has succeeded
            self._commit(state, new_entries)
        return result

    def _commit(self, state, new_entries):
        """Write a segment's entries into the rings and advance mem_count (in place)."""
        write_segment([state[n] for n in self._mem_names], new_entries, state[io_spec.MEM_COUNT], self.mem_len)

    @functools.cached_property
    def _mem_names(self) -> list[str]:
        return [n for i in range(self.spec.n_layer) for n in (io_spec.mem_k(i), io_spec.mem_v(i))]
