"""ONNX Runtime backend: numpy and onnxruntime only (no torch), for servers and edge devices.

On the CPU the memory is a set of numpy ring buffers owned by the backend. ONNX Runtime reads them in place (no
copy for contiguous host arrays); an `incremental` graph returns only this segment's keys and values, which are
written into their ring slots here, so no step copies or reallocates the whole memory.
On CUDA a `full`-state graph keeps the memory on the device: two sets of device buffers bound with IO binding and
swapped by reference each step (the outputs of step t are the inputs of step t + 1), never copied to the host.

On the CPU every weight is held once, by the backend: the model's graph and its adaptive-softmax parts (the head
graph repeats the body and the tied embedding, each tail graph its cluster's rows) are read tensor by tensor into
one pool of numpy arrays, equal tensors merged, and each session gets the pooled arrays as its initializers
(`SharedWeights`) instead of a copy of its own. ONNX Runtime's prepacking is off for the same reason: a packed
copy per MatMul would double the output layer that the tied embedding also reads, in every session. Quantized
graphs are the exception: their kernels run from packed weights (int4's MatMulNBits unpacks every weight to fp32 at
every call without them), so their sessions prepack and hold their own (small) weights.

An `.ort` (the ONNX Runtime format, `txl-deploy export --ort-format`) runs here too. It is a flatbuffer that only
ONNX Runtime reads: its metadata comes from the session (`custom_metadata_map`, which the converter keeps) and is
validated as an .onnx's is.
"""

from __future__ import annotations

import logging
import sys
import warnings

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract import parts as parts_contract
from txl_deploy.contract.metadata import ExportInfo, read_onnx_info
from txl_deploy.contract.onnx_file import external_data
from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.heap import return_free_memory
from txl_deploy.runtimes.backends.weight_pool import SHARED_MIN_BYTES, SharedWeights
from txl_deploy.runtimes.host_rings import HostRingBackend

logger = logging.getLogger(__name__)

_GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
ORT_SUFFIX = ".ort"
# Precisions whose CPU kernels (MatMulNBits, DynamicQuantizeMatMul, QLinearMatMul) run from prepacked weights.
PACKED_PRECISIONS = ("int4", "int8", "int8-dynamic")


def choose_providers(requested=None) -> list:
    import onnxruntime as ort  # optional (the cpu or gpu extra)

    available = ort.get_available_providers()
    if requested is None:
        return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]
    names = [p if isinstance(p, str) else p[0] for p in requested]
    short = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider"}
    out = []
    for p, name in zip(requested, names):
        full = short.get(name.lower(), name)
        if full not in available:
            raise InputError(f"ONNX Runtime provider {name!r} is not available here (available: "
                             f"{', '.join(available)}); onnxruntime-gpu brings CUDA and TensorRT")
        out.append(full if isinstance(p, str) else (full, p[1]))
    return out


class OrtBackend(HostRingBackend):
    name = "onnxruntime"

    def __init__(self, path, providers=None, intra_op_threads: int | None = None, profile_prefix: str | None = None,
                 prepack: bool | None = None):
        """prepack: let ONNX Runtime prepack the MatMul weights, each session its own copies (no shared pool).
        For an fp32 or fp16 graph a prefill's segments then run faster (a 64-token WikiText-103 base segment took
        232 against 299 ms of CPU time on one thread), a decode step slower (44.4 against 40.7 ms), and the
        sessions of a model with its adaptive-softmax parts hold 2.11 GiB instead of 611 MiB
        (benchmarks/results_peak_ram_runtime.md). None (the default): off for fp32 and fp16 graphs, on for the
        quantized ones, whose kernels take their weights in a packed form of their own: without it int4's
        MatMulNBits unpacks every weight to fp32 at every call (a demo-model decode step took 8.3 against 1.2 ms
        of CPU time, int8-dynamic 1.19 against 1.01 ms), and their weights are a fraction of fp32's."""
        self.path = str(path)
        ort_format = str(path).lower().endswith(ORT_SUFFIX)
        self.prepack = bool(prepack) if prepack is not None else False
        if not ort_format:
            self.info = read_onnx_info(path)
            if prepack is None:
                self.prepack = self.info.precision in PACKED_PRECISIONS
            external_data(path)  # refuses data files outside the model's folder before ONNX Runtime opens any
        self._providers = choose_providers(providers)
        self._intra_op_threads, self._profile_prefix, self._ort_format = intra_op_threads, profile_prefix, ort_format
        if intra_op_threads:
            self.threads = int(intra_op_threads)
        # Weights shared between the sessions: only where every session runs on the CPU and reads a .onnx (an .ort
        # file's tensors live in its flatbuffer).
        cpu_only = all((p if isinstance(p, str) else p[0]) == "CPUExecutionProvider" for p in self._providers)
        shared = cpu_only and not ort_format and not self.prepack and sys.byteorder == "little"
        self.weights = SharedWeights(SHARED_MIN_BYTES) if shared else None
        self.session = self._open(self.path, self.path)
        if ort_format:
            try:
                props = dict(self.session.get_modelmeta().custom_metadata_map)
            except UnicodeDecodeError:  # ONNX Runtime hands the file's strings over as they are
                raise CheckpointError(path, "corrupt txl-deploy metadata (not UTF-8)") from None
            self.info = ExportInfo.from_props(props, path)
            if prepack is None and self.info.precision in PACKED_PRECISIONS:  # known once the flatbuffer is open
                self.prepack = True
                self.session = self._open(self.path, self.path)
        self.config, self.vocab = self.info.config, self.info.vocab
        self.mem_len, self.max_segment, self.precision = self.info.mem_len, self.info.max_segment, self.info.precision
        self.spec = self.info.spec()
        try:
            inputs = {i.name: i for i in self.session.get_inputs()}
        except UnicodeDecodeError:  # a damaged .ort file: ONNX Runtime hands its names over as they are
            raise CheckpointError(path, "corrupt graph (an input name is not UTF-8)") from None
        missing = [n for n in self.spec.input_names() if n not in inputs]
        if missing:
            raise CheckpointError(path, f"graph lacks the inputs its metadata declares ({', '.join(missing[:3])})")
        if len(inputs[io_spec.mem_k(0)].shape) != 4:
            raise CheckpointError(path, f"graph's {io_spec.mem_k(0)} is not the [B, H, d_head, M] its metadata declares")
        self.float_dtype = np.float16 if inputs[io_spec.mem_k(0)].type == "tensor(float16)" else np.float32
        self.output_names = self.spec.output_names()
        # Incremental graphs take a 1-slot memory for streams that have consumed nothing (cached.CachedTxl).
        self.fresh_prefill = self.spec.state == "incremental" and isinstance(inputs[io_spec.mem_k(0)].shape[3], str)
        self._one_slot = {}
        on_gpu = self.session.get_providers()[0] in _GPU_PROVIDERS
        self.on_device = on_gpu and self.spec.state == "full"
        if on_gpu and not self.on_device:
            warnings.warn(f"{path}: an 'incremental' graph on {self.session.get_providers()[0]} keeps its memory on "
                          "the host and copies it to the GPU every step; export with --state full to keep it on "
                          "the device", stacklevel=3)
        self.parts_error = None  # why the model's softmax parts were refused (a CheckpointError), if they were
        self._head, self._tails = None, []
        if not ort_format and not self.on_device:
            self._open_parts()

    def _options(self):
        import onnxruntime as ort  # optional (the cpu or gpu extra)

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        # No CPU arena: it keeps the high-water mark of every call (a 512-token prefill over a 267,735-word
        # vocabulary needs 2.3 GB of temporaries) and grows in powers of two. Measured without it: the same decode
        # speed (WikiText-103-large shape 47 vs 51 ms, demo 0.40 vs 0.40 ms) and 0.7 GB less after a prefill.
        opts.enable_cpu_mem_arena = False
        # No prepacking: a MatMul's packed copy of its weight is a second copy of it (the tied output weight is also
        # read by the embedding's Gather), and packed copies cannot be shared between sessions. Measured on the
        # WikiText-103 base stand-in, one thread: decode 40.7 vs 44.4 ms of CPU a step without it, RSS added by the
        # main session 628 vs 1,080 MB for 608 MB of weights (benchmarks/results_efficiency.md). A prefill pays for
        # it (see `prepack`).
        if not self.prepack:
            opts.add_session_config_entry("session.disable_prepacking", "1")
        if self._intra_op_threads:
            opts.intra_op_num_threads = int(self._intra_op_threads)
            # The session runs its graph sequentially (ORT_SEQUENTIAL): an inter-op pool would only add idle
            # threads competing for the same cores.
            opts.inter_op_num_threads = 1
        if self._profile_prefix:
            opts.enable_profiling = True
            opts.profile_file_prefix = str(self._profile_prefix)
        if self._ort_format:
            # Never guessed from the bytes: a file named .ort is read as the ONNX Runtime format only.
            opts.add_session_config_entry("session.load_model_format", "ORT")
        return opts

    def _open(self, path, shown):
        """A session of the graph at `path`, its weights from the pool where there is one (`shown`: the file named
        in a refusal)."""
        import onnxruntime as ort  # optional (the cpu or gpu extra)

        opts = self._options()
        try:
            if self.weights is None:
                return ort.InferenceSession(str(path), opts, providers=self._providers)
            session = ort.InferenceSession(self.weights.attach(path, opts), opts, providers=self._providers)
            # The graph optimisers read the weights through copies that they free; the heap keeps what it freed
            # below glibc's mmap threshold (the body's weights): 184 of the 797 MB a WikiText-103 base session
            # held otherwise.
            return_free_memory()
            return session
        except InputError:
            raise
        except Exception as e:
            raise CheckpointError(shown, f"ONNX Runtime cannot load it ({str(e).splitlines()[0][:200]})") from None

    def _open_parts(self):
        """Open the adaptive softmax's head and tail graphs the metadata lists, each checked to be the file the
        model names (folder, sha256, external data). A refused part is logged and leaves the full path: `clusters`
        stays None and run_head raises the refusal."""
        try:
            parts = parts_contract.Parts.from_export(self.info.export, self.config, self.path)
            if parts is None:
                return
            made_for = self.info.export[parts_contract.KEY].get("precision")
            if made_for != self.precision:  # a graph derived from the fp32 export keeps its metadata
                raise CheckpointError(self.path, f"its softmax parts are {str(made_for)[:20]} graphs, the model "
                                                 f"is {self.precision}")
            files = parts.files(self.path)
            sessions = []
            for f in files:
                external_data(f)
                sessions.append(self._open(f, f))
            head_outputs = [o.name for o in sessions[0].get_outputs()]
            if head_outputs[:2] != [parts_contract.HIDDEN, parts_contract.HEAD_LOG_PROBS]:
                raise CheckpointError(files[0], "not a head graph (its outputs are not hidden, head_log_probs)")
        except CheckpointError as e:
            self.parts_error = e
            logger.warning(f"{e}; computing full distributions only")
            return
        self._head, self._tails, self.clusters = sessions[0], sessions[1:], parts.layout
        self._head_outputs = head_outputs

    def fingerprint(self) -> str:
        return f"kv-{self.info.fingerprint()}-{np.dtype(self.float_dtype).name}"

    # -- state: the base's host rings, or on the GPU two sets of device buffers ------------------------------------
    def _adopt(self, arrays):
        return _DeviceState(self, arrays) if self.on_device else arrays

    def _host(self, state) -> dict:
        return state.to_numpy() if isinstance(state, _DeviceState) else dict(state)

    def state_batch(self, state) -> int:
        return state.batch if isinstance(state, _DeviceState) else super().state_batch(state)

    def reset_rows(self, state, rows):
        if isinstance(state, _DeviceState):
            arrays = state.to_numpy()
            super().reset_rows(arrays, rows)
            state.upload(arrays)
        else:
            super().reset_rows(state, rows)

    # -- compute ----------------------------------------------------------------------------------------------
    def run_fixed(self, state, tokens, out_positions):
        if isinstance(state, _DeviceState):
            raise NotImplementedError("a memory kept on the GPU always advances")
        return super().run_fixed(state, tokens, out_positions)

    def run_head(self, state, tokens, out_positions):
        if self.clusters is None:
            if self.parts_error is not None:
                raise self.parts_error
            return super().run_head(state, tokens, out_positions)
        return tuple(self._run(state, tokens, out_positions, advance=True, session=self._head, n_out=2,
                               output_names=self._head_outputs))

    def run_tail(self, i, hidden, head_log_prob):
        if self.clusters is None:
            return super().run_tail(i, hidden, head_log_prob)
        if not 1 <= i <= self.clusters.n_clusters:
            raise InputError(f"tail cluster {i} does not exist (the model has {self.clusters.n_clusters})")
        (out,) = self._tails[i - 1].run(None, {parts_contract.HIDDEN: np.ascontiguousarray(hidden, np.float32),
                                               parts_contract.HEAD_LOG_PROB: np.ascontiguousarray(head_log_prob,
                                                                                                  np.float32)})
        return out

    def _run(self, state, tokens, out_positions, advance: bool, **how):
        if isinstance(state, _DeviceState):
            return state.run(tokens, out_positions)
        try:
            return super()._run(state, tokens, out_positions, advance, **how)
        finally:
            if tokens.shape[1] > 1:
                # A prompt's temporaries (a 512-position chunk's attention and feed-forward, MBs each) are freed
                # into the heap, which keeps them: hand them back, or the runtime holds the largest prompt's
                # working set for good. Decode steps (one token) skip it; a trim costs far less than a prompt.
                return_free_memory()

    def _execute(self, state, tokens, out_positions, advance: bool, session=None, n_out: int = 1,
                 output_names=None):
        session, output_names = session or self.session, output_names or self.output_names
        feeds = dict(state)
        if self.fresh_prefill and not state[io_spec.MEM_COUNT].any():
            feeds.update(self._empty_memory(tokens.shape[0]))
        feeds[io_spec.TOKENS], feeds[io_spec.OUT_POSITIONS] = tokens, out_positions
        outs = session.run(output_names if advance else output_names[:n_out], feeds)
        results = [o if o.dtype == np.float32 else o.astype(np.float32) for o in outs[:n_out]]
        return (results[0] if n_out == 1 else results), outs[n_out:]

    def _commit(self, state, new_entries):
        if self.spec.state == "incremental":
            super()._commit(state, new_entries)
        else:  # a full-state graph returns the whole next memory
            for name, value in zip(self.output_names[len(self.output_names) - len(new_entries):], new_entries):
                state[_input_for(name)] = value

    def _empty_memory(self, batch: int) -> dict:
        """1-slot zero buffers standing in for an empty memory (allocated once per batch size)."""
        if batch not in self._one_slot:
            spec, empty = self.spec, {}
            for i in range(spec.n_layer):
                empty[io_spec.mem_k(i)] = np.zeros(spec.k_shape(batch, slots=1), dtype=self.float_dtype)
                empty[io_spec.mem_v(i)] = np.zeros(spec.v_shape(batch, slots=1), dtype=self.float_dtype)
            self._one_slot[batch] = empty
        return self._one_slot[batch]


def _input_for(output_name: str) -> str:
    return output_name.removeprefix("next_")


class _DeviceState:
    """The memory on the GPU: two sets of OrtValues, inputs and outputs, swapped after every step."""

    def __init__(self, backend: OrtBackend, arrays: dict):
        import onnxruntime as ort  # optional (the cpu or gpu extra)

        self.backend, self.ort = backend, ort
        self.batch = arrays[io_spec.MEM_COUNT].shape[0]
        self.pairing = backend.spec.pairing()  # input -> output
        self.upload(arrays)

    def upload(self, arrays):
        dev = ("cuda", 0)
        self.cur = {k: self.ort.OrtValue.ortvalue_from_numpy(v, *dev) for k, v in arrays.items()}
        self.nxt = {k: self.ort.OrtValue.ortvalue_from_numpy(np.zeros_like(v), *dev) for k, v in arrays.items()}

    def to_numpy(self) -> dict:
        return {k: v.numpy() for k, v in self.cur.items()}

    def run(self, tokens, out_positions):
        sess = self.backend.session
        io = sess.io_binding()
        io.bind_cpu_input(io_spec.TOKENS, tokens)
        io.bind_cpu_input(io_spec.OUT_POSITIONS, out_positions)
        io.bind_output(io_spec.LOG_PROBS, "cpu")
        for name, value in self.cur.items():
            io.bind_ortvalue_input(name, value)
            io.bind_ortvalue_output(self.pairing[name], self.nxt[name])
        sess.run_with_iobinding(io)
        log_probs = io.copy_outputs_to_cpu()[0]
        self.cur, self.nxt = self.nxt, self.cur  # zero-copy: this step's outputs are the next step's inputs
        return log_probs.astype(np.float32, copy=False)
