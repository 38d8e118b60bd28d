"""OpenVINO's CPU plugin on txl-deploy's own `.onnx` file, driven from docs/graph-contract.md alone: a peer in the
benchmark, not a runtime of the project. Compiled as a careful user would (threads, one stream, the latency hint,
an f32 precision hint unless `precision_hint=None`); decode steps run a copy reshaped to static shapes per batch
size, so that the plugin plans every buffer once; anything else runs the dynamic model."""

from __future__ import annotations

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.runtimes.host_rings import HostRingBackend


def cpu_default_precision() -> str:
    """The inference precision OpenVINO's CPU plugin uses on this machine unless told otherwise."""
    import openvino as ov  # optional (the test extra: a peer the benchmark compares with)

    return _type_name(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))


def _type_name(t) -> str:
    return getattr(t, "get_type_name", lambda: str(t))()


class OpenVinoBackend(HostRingBackend):
    name = "openvino"

    def __init__(self, path, precision_hint: str | None = "f32", threads: int | None = 1):
        import openvino as ov  # optional (the test extra: a peer the benchmark compares with)

        self.path = str(path)
        self.info = read_onnx_info(path)
        self.spec = self.info.spec()
        if self.spec.state != "incremental":
            raise InputError(f"{path}: the OpenVINO peer drives incremental graphs (export with --state incremental)")
        self.config, self.vocab = self.info.config, self.info.vocab
        self.mem_len, self.max_segment, self.precision = self.info.mem_len, self.info.max_segment, self.info.precision
        self.threads = int(threads) if threads else None
        self.properties = {"NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
        if self.threads:
            self.properties["INFERENCE_NUM_THREADS"] = self.threads
        if precision_hint:
            self.properties["INFERENCE_PRECISION_HINT"] = precision_hint
        self._ov, self._core = ov, ov.Core()
        try:
            model = self._core.read_model(self.path)
            self._dynamic = _Compiled(self._core.compile_model(model, "CPU", self.properties), self.spec)
        except Exception as e:
            raise CheckpointError(path, f"OpenVINO cannot load it ({str(e).splitlines()[0][:200]})") from None
        self.inference_precision = _type_name(self._dynamic.compiled.get_property("INFERENCE_PRECISION_HINT"))
        k_type = next(i for i in model.inputs if io_spec.mem_k(0) in i.get_names()).get_element_type()
        self.float_dtype = np.float16 if _type_name(k_type) == "f16" else np.float32
        self._static = {}  # batch size -> the decode step compiled with static shapes

    def fingerprint(self) -> str:
        # The ONNX Runtime backend's: the state is the contract's, so it moves between the two engines.
        return f"kv-{self.info.fingerprint()}-{np.dtype(self.float_dtype).name}"

    # -- state: the contract's numpy arrays, written after each call (HostRingBackend) ---------------------------
    # -- compute -------------------------------------------------------------------------------------------------
    def _decode_model(self, batch: int):
        if batch not in self._static:
            spec, model = self.spec, self._core.read_model(self.path)
            shapes = {io_spec.TOKENS: [batch, 1], io_spec.OUT_POSITIONS: [batch, 1], io_spec.MEM_COUNT: [batch]}
            for i in range(spec.n_layer):
                shapes[io_spec.mem_k(i)] = list(spec.k_shape(batch))
                shapes[io_spec.mem_v(i)] = list(spec.v_shape(batch))
            model.reshape({name: self._ov.PartialShape(shape) for name, shape in shapes.items()})
            self._static[batch] = _Compiled(self._core.compile_model(model, "CPU", self.properties), spec)
        return self._static[batch]

    def _execute(self, state, tokens, out_positions, advance):
        B, Q = tokens.shape
        decode = Q == 1 and out_positions.shape[1] == 1
        compiled = self._decode_model(B) if decode else self._dynamic
        outs = compiled.infer({io_spec.TOKENS: tokens, io_spec.OUT_POSITIONS: out_positions, **state})
        return np.array(outs[0], dtype=np.float32), outs[1:]

    def close(self):
        self._static.clear()
        self._dynamic = None


class _Compiled:
    """A compiled model, its infer request, and its output ports in the contract's output order."""

    def __init__(self, compiled, spec):
        self.compiled = compiled
        self.request = compiled.create_infer_request()
        ports = {}
        for port in compiled.outputs:
            for name in port.get_names():
                ports[name] = port
        self.ports = [ports[name] for name in spec.output_names()]

    def infer(self, feeds: dict) -> list:
        self.request.infer(feeds, share_inputs=True)
        return [self.request.get_tensor(port).data for port in self.ports]
