"""User-facing errors.

Every problem a user can cause (a bad file, a bad token id, a wrong shape) is raised as a `TxlError` subclass
with a one-line message naming the thing and the problem. The CLI prints it and exits with code 2; library
callers can catch the specific class. Nothing here imports torch.
"""

import os


class TxlError(Exception):
    """Base class of every error txl-deploy raises on purpose."""

    exit_code = 2


class CheckpointError(TxlError):
    """A checkpoint or model file that cannot be read as what it claims to be."""

    def __init__(self, path, problem):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class InputError(TxlError, ValueError):
    """Bad input to a runtime call (token ids, shapes, dtypes, state)."""


class ExportError(TxlError):
    """An export or verification that failed."""


class OutputExistsError(TxlError):
    """An output file exists and --force was not given."""

    def __init__(self, path):
        super().__init__(f"{path}: already exists (pass --force to overwrite)")


# The extra that brings each optional package a command may import (pyproject's optional-dependencies).
EXTRA_OF_PACKAGE = {
    "torch": "torch", "safetensors": "torch", "onnxscript": "torch", "onnxruntime": "cpu", "tensorrt": "tensorrt",
    "cuda": "tensorrt", "executorch": "executorch", "torchao": "executorch", "sacremoses": "text",
    "huggingface_hub": "hub", "fastapi": "serve", "uvicorn": "serve", "sse_starlette": "serve",
    "prometheus_client": "serve", "tritonclient": "triton", "matplotlib": "bench", "threadpoolctl": "bench",
    "mido": "music",
}


def missing_package_hint(error: ModuleNotFoundError) -> str | None:
    """One line naming the extra that brings the package `error` could not import, or None for any other."""
    package = (error.name or "").split(".")[0]
    extra = EXTRA_OF_PACKAGE.get(package)
    return None if extra is None else f"{package} is not installed (the {extra} extra): {install_hint(extra)}"


def install_hint(*extras: str) -> str:
    """The pip command that installs `extras` where this copy of txl-deploy runs.

    In a source checkout (this package's folder beside a pyproject.toml) the published name would fetch another
    copy from the index, so the hint installs the checkout itself: `pip install -e '.[serve]'` from its root,
    the checkout's path from anywhere else.
    """
    names = ",".join(extras)
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    if not os.path.isfile(os.path.join(root, "pyproject.toml")):
        return f"pip install 'txl-deploy[{names}]'"
    try:
        here = os.path.realpath(os.getcwd())
    except OSError:  # the working directory was removed
        here = None
    return f"pip install -e '{'.' if here == root else root}[{names}]'"
