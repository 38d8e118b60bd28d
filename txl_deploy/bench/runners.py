"""What MODEL means to `bench` (an .onnx, a TensorRT engine, a .pte, a checkpoint or a published shape name,
exported on the fly), and how each side of the comparison is opened (`opener`), the eager baselines included."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from txl_deploy.bench.eager_baseline import EagerAtPositions
from txl_deploy.bench.random_weights import is_shape_name, standin_checkpoint, standin_onnx
from txl_deploy.checkpoints import load_model
from txl_deploy.config import PUBLISHED_SHAPES
from txl_deploy.contract.engine_file import read_sidecar
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.pte_file import read_pte_info
from txl_deploy.errors import InputError
from txl_deploy.runtimes import BACKENDS, TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend
from txl_deploy.runtimes.backends.pytorch import TorchCachedBackend, TorchEagerBackend

logger = logging.getLogger(__name__)

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


@dataclass
class Source:
    kind: str  # "onnx", "engine", "pte", "checkpoint", "shape"
    path: Path | None  # the file (onnx / engine) or checkpoint
    checkpoint: Path | None  # for the eager baseline and on-the-fly exports
    fixed_mem_len: int | None  # an exported graph's own memory length

    @property
    def default_backend(self) -> str:
        return {"onnx": "onnxruntime", "engine": "tensorrt", "pte": "executorch"}.get(self.kind, "onnxruntime")


def resolve(model: str, reference=None, cache_dir=None) -> Source:
    ref = Path(reference) if reference else None
    if ref is not None and not ref.exists():
        raise InputError(f"{ref}: reference checkpoint not found")
    if is_shape_name(model) and not Path(model).exists():
        return Source("shape", None, standin_checkpoint(model, cache_dir), None)
    path = Path(model)
    if not path.exists():
        raise InputError(f"{model}: no such file, and not a published shape name ({', '.join(PUBLISHED_SHAPES)})")
    suffix = path.suffix.lower()
    if suffix == ".onnx":
        return Source("onnx", path, ref, read_onnx_info(path).mem_len)
    if suffix in ENGINE_SUFFIXES:
        return Source("engine", path, ref, int(read_sidecar(path)["export"]["mem_len"]))
    if suffix == ".pte":
        return Source("pte", path, ref, read_pte_info(path, check_hash=False).mem_len)
    return Source("checkpoint", path, path, None)


def mem_lens_for(source: Source, requested: list[int] | None) -> list[int]:
    if source.fixed_mem_len is not None:
        if requested and any(m != source.fixed_mem_len for m in requested):
            raise InputError(f"{source.path}: the graph's memory length is fixed at {source.fixed_mem_len}; "
                             f"--mem-len {','.join(map(str, requested))} needs a checkpoint or a shape name")
        return [source.fixed_mem_len]
    if requested:
        return list(requested)
    mem_len = load_model(source.checkpoint).config.mem_len
    if mem_len <= 0:
        raise InputError(f"{source.checkpoint}: the model has no memory length (mem_len {mem_len}); pass --mem-len")
    return [mem_len]


def opener(source: Source, backend: str, mem_len: int, *, device: str = "cpu", threads: int | None = None,
           providers=None, state: str = "incremental", max_segment: int = 512, cache_dir=None):
    """A zero-argument function that opens a `TxlRuntime` of `backend` for `source` at `mem_len`."""
    if backend in ("torch", "torch-fast", "eager", "eager-as-written"):
        if source.checkpoint is None:
            raise InputError(f"{source.path}: the {backend} backend needs the checkpoint; pass --reference CKPT")

        def open_torch():
            torch_threads(threads)
            klass = {"torch": TorchEagerBackend, "eager-as-written": TorchEagerBackend, "eager": EagerAtPositions,
                     "torch-fast": TorchCachedBackend}[backend]
            return TxlRuntime(klass.from_checkpoint(source.checkpoint, device=device, mem_len=mem_len,
                                                    max_segment=max_segment))
        return open_torch
    if backend == "onnxruntime":
        if source.kind == "onnx":
            path = source.path
        elif source.kind in ("checkpoint", "shape"):
            path = standin_onnx(source.checkpoint, cache_dir, mem_len, state=state, max_segment=max_segment)
        else:
            own = {"engine": "a TensorRT engine runs on the tensorrt",
                   "pte": "an ExecuTorch program runs on the executorch"}[source.kind]
            raise InputError(f"{source.path}: {own} backend only")
        providers = providers or (["cuda"] if device.startswith("cuda") else ["cpu"])
        return lambda: TxlRuntime(OrtBackend(path, providers=providers, intra_op_threads=threads))
    if backend == "tensorrt":
        if source.kind != "engine":
            raise InputError("the tensorrt backend benchmarks a built engine: pass MODEL.engine "
                             "(txl-deploy build-engine makes one)")
        return lambda: TxlRuntime.load(source.path, backend="tensorrt")
    if backend == "executorch":
        if source.kind != "pte":
            raise InputError("the executorch backend benchmarks an exported program: pass MODEL.pte "
                             "(txl-deploy export CKPT --executorch makes one)")
        return lambda: TxlRuntime.load(source.path, backend="executorch", threads=threads)

    raise InputError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def torch_threads(threads):
    if threads:
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        torch.set_num_threads(int(threads))
