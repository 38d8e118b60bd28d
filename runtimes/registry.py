"""Which backend runs a file, and opening it: `.onnx` and `.ort` -> ONNX Runtime, `.engine` -> TensorRT, `.pte` ->
ExecuTorch, a checkpoint -> PyTorch. Each backend imports its engine (onnxruntime, tensorrt, executorch, torch) only
when a file is opened with it: a machine with ONNX Runtime alone never needs the others."""

from __future__ import annotations

import warnings
from pathlib import Path

from txl_deploy.errors import CheckpointError, InputError
from txl_deploy.runtimes.arguments import check_threads
from txl_deploy.runtimes.backend import Backend
from txl_deploy.runtimes.backends.executorch import ExecuTorchBackend
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend
from txl_deploy.runtimes.backends.pytorch import TorchCachedBackend, TorchEagerBackend
from txl_deploy.runtimes.backends.tensorrt import TensorRTBackend

BACKENDS = ("onnxruntime", "tensorrt", "executorch", "torch", "torch-fast")

TENSORRT_THREADS_NOTE = ("threads= has no effect on the TensorRT backend: the model runs on the GPU, and the host "
                         "only copies tokens and log-probabilities")


def backend_for(path: Path, backend: str | None = None) -> str:
    """The backend that runs `path`: `backend` when given, else by the file's kind."""
    if backend:
        return backend
    suffix = Path(path).suffix.lower()
    if suffix in (".onnx", ".ort"):  # .ort: the ONNX Runtime format (export --ort-format)
        return "onnxruntime"
    if suffix in (".engine", ".plan", ".trt"):
        return "tensorrt"
    if suffix == ".pte":
        return "executorch"
    return "torch"


def open_backend(path, backend: str | None = None, providers=None, device: str | None = None,
                 mem_len: int | None = None, max_segment: int | None = None, clamp_len: int | None = None,
                 same_length: bool | None = None, threads: int | None = None) -> Backend:
    """The backend for `path`, opened (see `TxlRuntime.load` for the arguments). An exported graph has its settings
    built in: asking it for other values is an InputError that says to re-export."""
    threads = check_threads(threads)
    path = Path(path)
    if not path.exists():
        raise CheckpointError(path, "file not found")
    kind = backend_for(path, backend)
    overrides = {k: v for k, v in (("clamp_len", clamp_len), ("same_length", same_length)) if v is not None}
    if kind == "onnxruntime":
        impl = OrtBackend(path, providers=providers, intra_op_threads=threads)
    elif kind == "tensorrt":
        if threads is not None:
            warnings.warn(TENSORRT_THREADS_NOTE, RuntimeWarning, stacklevel=3)

        impl = TensorRTBackend(path)
    elif kind == "executorch":
        impl = ExecuTorchBackend(path, threads=threads)
    elif kind in ("torch", "torch-fast"):
        klass = TorchEagerBackend if kind == "torch" else TorchCachedBackend
        return klass.from_checkpoint(path, device=device, mem_len=mem_len, max_segment=max_segment,
                                     overrides=overrides, threads=threads)
    else:
        raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    wanted = {"mem_len": mem_len, **overrides}
    built_in = {"mem_len": impl.mem_len, "clamp_len": impl.config.clamp_len, "same_length": impl.config.same_length}
    for key, value in wanted.items():
        if value is not None and value != built_in[key]:
            impl.close()
            raise InputError(f"{path} was exported with {key}={built_in[key]}; re-export it with the "
                             f"checkpoint to use {key}={value}")
    if max_segment is not None:
        # Shorter pieces than the graph allows are only a choice of how input is split; longer ones are beyond
        # the graph's table of relative positions (docs/graph-contract.md).
        if max_segment > impl.max_segment:
            impl.close()
            raise InputError(f"{path} was exported with max_segment={impl.max_segment}; re-export it with "
                             f"--max-segment {max_segment} to feed longer segments")
        impl.max_segment = max_segment
    return impl
