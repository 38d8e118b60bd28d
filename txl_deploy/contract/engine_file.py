"""The TensorRT engine file format: an engine plus its JSON sidecar, and what it takes to load one.

Both the builder (exporters/tensorrt.py) and the runtime (runtimes/tensorrt.py) need this; it lives here so that
the runtimes never import the exporters (the exporters import the runtimes to verify what they wrote).

Every engine has a JSON sidecar `<engine>.json` (TensorRT version, GPU, precision, profiles, model config and
vocabulary): an engine only runs on the TensorRT version and GPU architecture it was built for, and the sidecar
lets the runtime say so before TensorRT fails with a cryptic deserialization error.

No torch, no pycuda: the GPU is queried through cuda-python. TensorRT API names used here are checked against
TensorRT 10.3, 10.16 and 11.4 by tests/exporters/test_tensorrt_api.py (the conventions are in exporters/tensorrt.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from txl_deploy.errors import CheckpointError, TxlError, install_hint

SIDECAR_FORMAT = "txl-deploy-tensorrt-engine"
SIDECAR_VERSION = 1


class TensorRTMissing(TxlError):
    """TensorRT (or cuda-python) is not installed, or no NVIDIA GPU is usable."""


INSTALL_HINT = (f"install it with `{install_hint('tensorrt')}` (TensorRT needs an NVIDIA GPU and NVIDIA's "
                "libraries; on Jetson it comes with JetPack)")


def import_tensorrt():
    try:
        import tensorrt as trt  # optional (the tensorrt extra)
    except ImportError as e:
        raise TensorRTMissing(f"TensorRT is not available ({e}); {INSTALL_HINT}") from None
    return trt


def gpu_info() -> dict:
    """Name and compute capability of CUDA device 0, through cuda-python (no torch, no pycuda)."""
    try:
        from cuda.bindings import runtime as cudart  # optional (the tensorrt extra)
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6 layout
        except ImportError:
            raise TensorRTMissing(f"cuda-python is not installed; {INSTALL_HINT}") from None
    err, props = cudart.cudaGetDeviceProperties(0)
    if int(err) != 0:
        raise TensorRTMissing(f"no usable NVIDIA GPU (cudaGetDeviceProperties: {err}); TensorRT needs one")
    name = props.name.decode(errors="replace").rstrip("\0") if isinstance(props.name, bytes) else str(props.name)
    return {"name": name, "compute_capability": f"{props.major}.{props.minor}",
            "memory_mib": int(props.totalGlobalMem) >> 20}


def make_logger(trt, errors: list):
    """A TensorRT logger that appends TensorRT's error messages to `errors`, so a failed build or load can say why
    (out of memory, unsupported node...). The caller keeps the list: TensorRT objects carry no attributes of ours."""

    class _RecordingLogger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)

        def log(self, severity, msg):
            if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                errors.append(msg)

    return _RecordingLogger()


# -- sidecar ----------------------------------------------------------------------------------------------------
def sidecar_path(engine_path) -> Path:
    engine_path = Path(engine_path)
    return engine_path.with_name(engine_path.name + ".json")


def read_sidecar(engine_path) -> dict:
    path = sidecar_path(engine_path)
    if not Path(engine_path).is_file():
        raise CheckpointError(engine_path, "engine file not found")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(engine_path, f"no sidecar {path.name} next to the engine; build engines with "
                                           "`txl-deploy build-engine` (it writes both)") from None
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: nested JSON
        raise CheckpointError(path, f"corrupt engine sidecar ({str(e)[:200]})") from None
    if not isinstance(meta, dict) or meta.get("format") != SIDECAR_FORMAT or "config" not in meta:
        raise CheckpointError(path, "not a txl-deploy engine sidecar")
    if int(meta.get("format_version", 0)) > SIDECAR_VERSION:
        raise CheckpointError(path, "written by a newer txl-deploy; upgrade txl-deploy")
    return meta


def check_sidecar_compatible(meta: dict, trt_version: str, gpu: dict | None, engine_path="<engine>"):
    """Refuse an engine built for another TensorRT release or GPU architecture, in words a user can act on.

    TensorRT engines are tied to the exact TensorRT version and to the GPU's compute capability (we do not build
    hardware- or version-compatible engines: they are slower). The patch-level build number may differ.
    """
    built = str(meta.get("tensorrt_version", "?"))
    if built.split(".")[:3] != str(trt_version).split(".")[:3]:
        raise CheckpointError(engine_path, f"built with TensorRT {built}, but TensorRT {trt_version} is installed; "
                                           "rebuild it with `txl-deploy build-engine` on this machine")
    built_gpu = meta.get("gpu") or {}
    if gpu is not None and built_gpu.get("compute_capability") != gpu.get("compute_capability"):
        raise CheckpointError(
            engine_path,
            f"built for {built_gpu.get('name', '?')} (compute capability {built_gpu.get('compute_capability', '?')}), "
            f"but this GPU is {gpu.get('name', '?')} (compute capability {gpu.get('compute_capability', '?')}); "
            "rebuild it with `txl-deploy build-engine` on this machine")


def load_engine(engine_path, trt=None):
    """Deserialize an engine after checking its sidecar; returns (engine, sidecar dict, runtime).

    The runtime is returned because the engine must not outlive it."""
    trt = trt or import_tensorrt()
    meta = read_sidecar(engine_path)
    check_sidecar_compatible(meta, trt.__version__, gpu_info(), engine_path)
    errors = []
    logger = make_logger(trt, errors)
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
    if engine is None:  # TensorRT logs the reason and returns None rather than raising
        why = "; ".join(errors[-3:])
        raise CheckpointError(engine_path, "TensorRT could not deserialize the engine (corrupt file, or built by "
                                           f"another TensorRT version or GPU){': ' + why if why else ''}")
    return engine, meta, runtime
