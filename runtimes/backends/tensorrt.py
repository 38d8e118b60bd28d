"""The TensorRT backend of TxlRuntime: device buffers through cuda-python, the memory never leaves the GPU.

Engines are built from the `full` state layout (exporters/tensorrt.py; the file format and loading are in
txl_deploy/engine_file.py): each step reads `mem_k.i`/`mem_v.i`/`mem_count` and writes `next_mem_*`. TensorRT
gives no guarantee that an output may alias an input, so every stream keeps two device buffer sets and swaps their
addresses after each step (ping-pong): no copy of the memory, and a failed step leaves the current set untouched.
Per step only the tokens go up and the log-probs come down.

The decode step (one token, one position) is captured in a CUDA graph per state and buffer parity: the addresses
baked into a graph are fixed, and the ping-pong alternates between exactly two address sets. The graph replays
the kernels of the run it was captured from (after a normal run, as TensorRT requires), so the tokens are copied
into the same fixed device buffer before each launch.

Tensor names, shapes and dtypes are read from the engine; config and vocabulary from its sidecar. No torch, no
pycuda: cuda-python's `cuda.bindings.runtime` (as in NVIDIA's own samples). Version-dependent TensorRT names follow
the conventions checked by tests/exporters/test_tensorrt_api.py.
"""

from __future__ import annotations

import weakref

import numpy as np

from txl_deploy.config import TxlConfig
from txl_deploy.contract import io_spec
from txl_deploy.contract.engine_file import import_tensorrt, load_engine
from txl_deploy.contract.metadata import ExportInfo
from txl_deploy.contract.ring import initial_mem_count
from txl_deploy.errors import CheckpointError, InputError, TxlError, install_hint
from txl_deploy.runtimes.backend import Backend, check_state
from txl_deploy.vocab import Vocab


def _cudart():
    try:
        from cuda.bindings import runtime as cudart  # optional (the tensorrt extra)
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError:
            raise TxlError(f"cuda-python is not installed; `{install_hint('tensorrt')}`") from None
    return cudart


def _ok(result, what):
    """cuda-python returns (error, *values): raise on error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise TxlError(f"CUDA error in {what}: {err}")
    return values[0] if len(values) == 1 else values


class _DeviceBuffer:
    def __init__(self, cudart, nbytes: int):
        self.cudart, self.nbytes = cudart, max(int(nbytes), 1)
        self.ptr = int(_ok(cudart.cudaMalloc(self.nbytes), "cudaMalloc"))  # 256-byte aligned, as TensorRT needs

    def free(self):
        if self.ptr:
            self.cudart.cudaFree(self.ptr)
            self.ptr = 0


class _TrtState:
    """One batch of streams' memory: two buffer sets on the device, `cur` feeds the next step."""

    def __init__(self, backend, batch: int):
        self.backend, self.batch = backend, batch
        self.sets = []
        for _ in range(2):
            self.sets.append({name: _DeviceBuffer(backend.cudart, backend.state_nbytes(name, batch))
                              for name in backend.state_names})
        self.parity = 0  # index of the current set
        self.graphs = {}  # parity -> cudaGraphExec of the decode step: its addresses are this state's buffers
        backend._states.add(self)

    @property
    def cur(self):
        return self.sets[self.parity]

    @property
    def nxt(self):
        return self.sets[1 - self.parity]

    def free(self):
        for exec_ in self.graphs.values():
            self.backend.cudart.cudaGraphExecDestroy(exec_)
        self.graphs = {}
        for s in self.sets:
            for buf in s.values():
                buf.free()
        self.sets = []

    def __del__(self):  # a state dropped by TxlRuntime.reset() gives its device memory back
        try:
            self.free()
        except Exception:
            pass


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, path, cuda_graphs: bool = True):
        self.trt = trt = import_tensorrt()
        self.cudart = _cudart()
        self.path = str(path)
        self.engine, self.meta, self.runtime = load_engine(path, trt)
        self.config = TxlConfig.from_dict(self.meta["config"])
        self.vocab = Vocab.from_dict(self.meta["vocab"]) if self.meta.get("vocab") else None
        self.info = ExportInfo(self.config, self.vocab, self.meta["export"])
        self.spec = self.info.spec()
        self.mem_len, self.precision = self.info.mem_len, self.meta.get("precision", "fp32")
        self.max_batch = int(self.meta["batch"][2])
        self.max_segment = int(self.meta["segment"][2])

        # Every tensor as the engine declares it (names, dtypes, static dims); the sidecar is not trusted for these.
        engine = self.engine
        self.tensors = {}
        for i in range(engine.num_io_tensors):
            name = engine.get_tensor_name(i)
            is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
            self.tensors[name] = (is_input, np.dtype(trt.nptype(engine.get_tensor_dtype(name))),
                                  tuple(engine.get_tensor_shape(name)))
        expected = set(self.spec.input_names()) | set(self.spec.output_names())
        if set(self.tensors) != expected:
            raise CheckpointError(path, "engine tensors differ from its sidecar's model "
                                        f"({sorted(set(self.tensors) ^ expected)[:4]})")
        self.pairing = self.spec.pairing()  # state input -> output
        self.state_names = [s.name for s in self.spec.state_inputs()]
        self.float_dtype = self.tensors[io_spec.mem_k(0)][1]

        self.context = engine.create_execution_context()
        if self.context is None:
            raise TxlError(f"{path}: TensorRT could not create an execution context (GPU memory exhausted?)")
        self.stream = _ok(self.cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._io = {}  # batch -> (tokens, out_positions, log_probs) device buffers sized for max_segment
        self._states = weakref.WeakSet()
        self.cuda_graphs = cuda_graphs
        self.bytes_to_device = self.bytes_to_host = 0  # traffic counters: the GPU tests check the memory stays put

    # -- sizes -------------------------------------------------------------------------------------------------
    def _shape(self, name, batch):
        return (batch,) + tuple(self.tensors[name][2][1:])

    def state_nbytes(self, name, batch) -> int:
        return int(np.prod(self._shape(name, batch))) * self.tensors[name][1].itemsize

    def fingerprint(self) -> str:
        # The same key as the ONNX Runtime backend: a saved state moves between backends of one export.
        return f"kv-{self.info.fingerprint()}-{self.float_dtype.name}"

    # -- host <-> device ---------------------------------------------------------------------------------------
    def _upload(self, ptr, array):
        array = np.ascontiguousarray(array)
        _ok(self.cudart.cudaMemcpyAsync(ptr, array.ctypes.data, array.nbytes,
                                        self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, self.stream), "upload")
        self.bytes_to_device += array.nbytes
        return array  # the caller keeps it alive until the stream is synchronised

    def _download(self, ptr, shape, dtype):
        out = np.empty(shape, dtype)
        _ok(self.cudart.cudaMemcpyAsync(out.ctypes.data, ptr, out.nbytes,
                                        self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost, self.stream), "download")
        self.bytes_to_host += out.nbytes
        return out

    def _sync(self):
        _ok(self.cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")

    # -- state ---------------------------------------------------------------------------------------------------
    def _check_batch(self, batch):
        lo = int(self.meta["batch"][0])
        if not lo <= batch <= self.max_batch:
            raise InputError(f"batch {batch} is outside this engine's profile ({lo}..{self.max_batch}); "
                             "rebuild it with `txl-deploy build-engine --batch MIN:OPT:MAX`")

    def new_state(self, batch: int):
        self._check_batch(batch)
        state = _TrtState(self, batch)
        for buf in state.cur.values():
            _ok(self.cudart.cudaMemsetAsync(buf.ptr, 0, buf.nbytes, self.stream), "cudaMemsetAsync")
        keep = self._upload_initial_counts(state, range(batch))
        self._sync()
        del keep
        return state

    def state_batch(self, state) -> int:
        return state.batch

    def state_arrays(self, state) -> dict:
        out = {n: self._download(state.cur[n].ptr, self._shape(n, state.batch), self.tensors[n][1])
               for n in self.state_names}
        self._sync()
        return out

    def state_layout(self, batch):
        return {n: (self._shape(n, batch), self.tensors[n][1]) for n in self.state_names}

    def state_from_arrays(self, arrays, copy=True):
        # uploaded to the device and dropped: no host copy is kept either way
        batch, checked = check_state(arrays, self.state_names, self._shape, lambda n: self.tensors[n][1], "engine",
                                     copy=False)
        self._check_batch(batch)
        state = _TrtState(self, batch)
        keep = [self._upload(state.cur[n].ptr, a) for n, a in checked.items()]
        self._sync()
        del keep
        return state

    def reset_rows(self, state, rows):
        # Zero the rows in place on the device: count 0 masks every slot; zeroed buffers keep 0 * stale-inf finite.
        for name in self.state_names:
            row = self.state_nbytes(name, 1)
            buf = state.cur[name]
            for r in np.atleast_1d(rows):
                _ok(self.cudart.cudaMemsetAsync(buf.ptr + int(r) * row, 0, row, self.stream), "cudaMemsetAsync")
        keep = self._upload_initial_counts(state, np.atleast_1d(rows))
        self._sync()
        del keep

    def select_rows(self, state, index):
        # Device-to-device row copies into the spare buffer set (a reorder, then flip to it) or a new state's.
        same = len(index) == state.batch
        if not same:
            self._check_batch(len(index))
        target = state if same else _TrtState(self, len(index))
        dst_set = state.nxt if same else target.cur
        for name in self.state_names:
            row = self.state_nbytes(name, 1)
            src, dst = state.cur[name].ptr, dst_set[name].ptr
            for r, i in enumerate(index):
                _ok(self.cudart.cudaMemcpyAsync(dst + r * row, src + int(i) * row, row,
                                                self.cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice, self.stream),
                    "cudaMemcpyAsync")
        self._sync()
        if same:
            state.parity = 1 - state.parity  # each parity's captured decode graph reads the set it names
        return target

    def _upload_initial_counts(self, state, rows) -> list:
        """A fresh row's mem_count where it is not 0 (REMI's attended zero memory: mem_len); the zeroed rings are
        its keys and values. Returns the host arrays to keep alive until the stream is synchronised."""
        count = initial_mem_count(self.config, self.mem_len)
        if not count:
            return []
        dtype = self.tensors[io_spec.MEM_COUNT][1]
        ptr = state.cur[io_spec.MEM_COUNT].ptr
        return [self._upload(ptr + int(r) * dtype.itemsize, np.array([count], dtype=dtype)) for r in rows]

    # -- compute ----------------------------------------------------------------------------------------------
    def _io_buffers(self, batch):
        if batch not in self._io:
            v = self.spec.n_token
            self._io[batch] = (
                _DeviceBuffer(self.cudart, batch * self.max_segment * self.tensors[io_spec.TOKENS][1].itemsize),
                _DeviceBuffer(self.cudart, batch * self.max_segment * self.tensors[io_spec.OUT_POSITIONS][1].itemsize),
                _DeviceBuffer(self.cudart, batch * self.max_segment * v * self.tensors[io_spec.LOG_PROBS][1].itemsize),
            )
        return self._io[batch]

    def _bind(self, state, q, p):
        context, b = self.context, state.batch
        tokens, positions, log_probs = self._io_buffers(b)
        context.set_input_shape(io_spec.TOKENS, (b, q))
        context.set_input_shape(io_spec.OUT_POSITIONS, (b, p))
        context.set_tensor_address(io_spec.TOKENS, tokens.ptr)
        context.set_tensor_address(io_spec.OUT_POSITIONS, positions.ptr)
        context.set_tensor_address(io_spec.LOG_PROBS, log_probs.ptr)
        for name in self.state_names:
            context.set_input_shape(name, self._shape(name, b))
            context.set_tensor_address(name, state.cur[name].ptr)
            context.set_tensor_address(self.pairing[name], state.nxt[name].ptr)

    def _execute(self, state, q, p):
        decode = q == 1 and p == 1 and self.cuda_graphs
        if decode and state.parity in state.graphs:
            _ok(self.cudart.cudaGraphLaunch(state.graphs[state.parity], self.stream), "cudaGraphLaunch")
            return
        self._bind(state, q, p)
        if not self.context.execute_async_v3(self.stream):
            raise TxlError(f"{self.path}: TensorRT execution failed (batch {state.batch}, segment {q})")
        if decode:
            self._capture(state)

    def _capture(self, state):
        """Record the decode step just run (shapes and addresses already set) as a CUDA graph."""
        cudart = self.cudart
        try:
            _ok(cudart.cudaStreamBeginCapture(self.stream,
                                              cudart.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal),
                "cudaStreamBeginCapture")
            ok = self.context.execute_async_v3(self.stream)
            graph = _ok(cudart.cudaStreamEndCapture(self.stream), "cudaStreamEndCapture")
            if ok:
                state.graphs[state.parity] = _ok(cudart.cudaGraphInstantiate(graph, 0), "cudaGraphInstantiate")
            cudart.cudaGraphDestroy(graph)
        except TxlError:
            # Some engines (e.g. with data-dependent shapes) cannot be captured; run those without a graph.
            self.cuda_graphs = False

    def run(self, state, tokens, out_positions):
        b, q = tokens.shape
        p = out_positions.shape[1]
        if q > self.max_segment:
            raise InputError(f"{q} tokens per call exceed this engine's segment profile (max {self.max_segment}); "
                             "rebuild it with a larger `--segment` MAX")
        if p > self.max_segment:
            raise InputError(f"{p} output positions exceed this engine's profile (max {self.max_segment})")
        tokens_buf, positions_buf, log_probs_buf = self._io_buffers(b)
        keep = (self._upload(tokens_buf.ptr, tokens.astype(self.tensors[io_spec.TOKENS][1], copy=False)),
                self._upload(positions_buf.ptr, out_positions.astype(self.tensors[io_spec.OUT_POSITIONS][1],
                                                                     copy=False)))
        self._execute(state, q, p)
        log_probs = self._download(log_probs_buf.ptr, (b, p, self.spec.n_token), self.tensors[io_spec.LOG_PROBS][1])
        self._sync()
        del keep
        state.parity = 1 - state.parity  # commit: this step's outputs are the next step's inputs
        return log_probs.astype(np.float32, copy=False)

    def close(self):
        for state in list(self._states):
            state.free()
        self._states = weakref.WeakSet()
        for bufs in self._io.values():
            for buf in bufs:
                buf.free()
        self._io = {}
        if getattr(self, "stream", None) is not None:
            self.cudart.cudaStreamDestroy(self.stream)
            self.stream = None
        # The context must go before the engine, and the engine before the runtime.
        self.context = self.engine = self.runtime = None
