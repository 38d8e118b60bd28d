"""ExecuTorch backend: a `.pte` program (and its `.pte.json` sidecar) run by ExecuTorch's Python runtime.

The program is the cached step with the `incremental` layout: it returns only this segment's keys and values, and
the memory is a set of numpy ring buffers owned by this backend, written after a run has succeeded, exactly as the
ONNX Runtime backend does (`host_rings`). ExecuTorch's bindings take torch tensors, which wrap
the numpy buffers without a copy (`torch.from_numpy`).

Threads: ExecuTorch runs XNNPACK's delegated ops on one thread pool for the whole process. `threads=N` resizes that
pool before the program is loaded, so it applies to every ExecuTorch program in the process, and only while no
other is open (see `_set_pool`); ops that were not delegated run on portable kernels, on the calling thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import types
import warnings
import weakref

import numpy as np

from txl_deploy.contract import io_spec
from txl_deploy.contract.pte_file import read_pte_info
from txl_deploy.errors import CheckpointError, InputError, install_hint
from txl_deploy.runtimes.host_rings import HostRingBackend

logger = logging.getLogger(__name__)

THREADS_NOTE = ("threads={threads} is not applied: ExecuTorch has one thread pool per process, which cannot be "
                "resized while the {others} other open .pte runtime(s) use it; this one runs with their {current} "
                "thread(s) (close them first, or open every .pte with the same threads=)")

# One thread pool per process: resizing it while a program runs on it is unsafe, so every execute and every
# resize holds this lock (XNNPACK's pool runs one parallel computation at a time anyway).
_POOL_LOCK = threading.Lock()
_OPEN = weakref.WeakSet()  # the ExecuTorch backends open in this process (for the threads warning)


def _import_runtime():
    """(torch, executorch.runtime.Runtime, the bindings module), or a one-line error naming the extra."""
    try:
        import torch  # optional (the executorch extra): ExecuTorch's bindings take and return torch tensors

        with _without_exir():
            from executorch.extension.pybindings import portable_lib  # optional (the executorch extra)
            from executorch.runtime import Runtime  # optional (the executorch extra)
    except ImportError as e:
        raise InputError(f"running a .pte needs ExecuTorch: {install_hint('executorch')} ({e})") from None
    return torch, Runtime, portable_lib


@contextlib.contextmanager
def _without_exir():
    """Import ExecuTorch's runtime without its compiler, `executorch.exir`. The bindings import exir's one module
    `_warnings` (a warning class), which runs exir's `__init__`: the whole compiler and torchao, seconds of imports
    and lines of other libraries' noise on every run. A bare package stands in for exir while the bindings load
    and is removed afterwards, so a later `import executorch.exir` (an export) imports the real one."""
    if "executorch.exir" in sys.modules:
        yield
        return
    import executorch  # optional (the executorch extra); its __init__ imports nothing

    bare = types.ModuleType("executorch.exir")
    bare.__path__ = [os.path.join(p, "exir") for p in executorch.__path__]
    sys.modules["executorch.exir"] = bare
    try:
        yield
    finally:
        for name in [n for n in sys.modules if n == "executorch.exir" or n.startswith("executorch.exir.")]:
            del sys.modules[name]
        if getattr(executorch, "exir", None) is bare:
            del executorch.exir


@contextlib.contextmanager
def _native_output_logged(what: str):
    """Run a load with the C++ runtime's own lines on stderr (XNNPACK's cpuinfo probing, written to file
    descriptor 2) captured and logged at DEBUG (`-v`). If the load fails they go to stderr as they were: they
    say which kernel or delegate refused. With DEBUG logging on, nothing is captured. The descriptor is the
    process's: another thread's stderr during the load is captured too."""
    if logger.isEnabledFor(logging.DEBUG):
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            yield
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode("utf-8", "replace").strip()
            if text and failed:
                sys.stderr.write(text + "\n")
            elif text:
                logger.debug(f"ExecuTorch while loading {what}:\n{text}")


class ExecuTorchBackend(HostRingBackend):
    name = "executorch"

    def __init__(self, path, threads: int | None = None):
        self.path = str(path)
        self.info = read_pte_info(path)  # the sidecar, checked against the program before ExecuTorch reads it
        self.torch, runtime, self._bindings = _import_runtime()
        self.config, self.vocab = self.info.config, self.info.vocab
        self.mem_len, self.max_segment, self.precision = self.info.mem_len, self.info.max_segment, self.info.precision
        self.spec = self.info.spec()
        if self.spec.state != "incremental":
            raise CheckpointError(path, "a .pte runs the incremental layout only (its sidecar says "
                                        f"{self.spec.state!r})")
        if threads is not None:
            self._set_pool(int(threads))
        try:
            with _native_output_logged(self.path):
                program = runtime.get().load_program(self.path)
                self.method = program.load_method("forward")
        except Exception as e:  # RuntimeError from the loader: not a program, or one built for other kernels
            raise CheckpointError(path, f"ExecuTorch cannot load it ({str(e).splitlines()[0][:200]})") from None
        if self.method is None:
            raise CheckpointError(path, "the ExecuTorch program has no forward method")
        self._program = program  # the method borrows the program's buffers: keep it alive as long as the method
        meta = self.method.metadata
        names = self.spec.input_names()
        if meta.num_inputs() != len(names) or meta.num_outputs() != len(self.spec.output_names()):
            raise CheckpointError(path, f"the program takes {meta.num_inputs()} inputs and returns "
                                        f"{meta.num_outputs()} outputs; its sidecar describes {len(names)} and "
                                        f"{len(self.spec.output_names())}")
        # Upper bounds of the dynamic axes, as the program was exported (its memory plan is sized for them).
        self.max_batch = int(meta.input_tensor_meta(0).sizes()[0])
        self.max_segment = min(self.max_segment, int(meta.input_tensor_meta(0).sizes()[1]))
        self.max_positions = int(meta.input_tensor_meta(1).sizes()[1])
        self._names = names
        _OPEN.add(self)

    def _set_pool(self, threads: int):
        """Size ExecuTorch's process-wide pool, before this program is loaded: XNNPACK's delegate keeps the pool it
        was loaded with, and resizing it under a loaded program crashes that program on its next new input shape
        (measured: a segmentation fault on the second call). So the pool is resized only while no other program
        of this process is open, and otherwise kept, with a warning, when it differs."""
        with _POOL_LOCK:
            current = self._bindings._threadpool_get_thread_count()
            if threads == current:
                self.threads = threads
                return
            others = [b for b in _OPEN if b.method is not None]
            if others:
                self.threads = current
                warnings.warn(THREADS_NOTE.format(others=len(others), current=current, threads=threads),
                              RuntimeWarning, stacklevel=5)
                return
            self._bindings._unsafe_reset_threadpool(threads)
            self.threads = threads

    def fingerprint(self) -> str:
        # fp32: the same state layout and weights as the fp32 ONNX graph of the same checkpoint, so a state saved by
        # either backend loads into the other. A quantized program's memory holds other numbers: its own.
        base = f"kv-{self.info.fingerprint()}-float32"
        return base if self.precision == "fp32" else f"{base}-pte-{self.precision}"

    # -- compute: the state and its commit are the base's ------------------------------------------------------
    def _execute(self, state, tokens, out_positions, advance: bool):
        if out_positions.shape[1] > self.max_positions:
            raise InputError(f"{self.path} returns log-probs for at most {self.max_positions} positions per call, "
                             f"got {out_positions.shape[1]}")
        # The program's slot axis is static (mem_len): a prompt into an empty memory is fed the zeroed buffers,
        # which mem_count masks, rather than the 1-slot stand-in an ONNX graph takes.
        feeds = dict(state)
        # torch.from_numpy wants writable arrays (it warns on read-only ones); the memory buffers are ours.
        feeds[io_spec.TOKENS] = np.require(tokens, np.int64, ("C", "W"))
        feeds[io_spec.OUT_POSITIONS] = np.require(out_positions, np.int64, ("C", "W"))
        inputs = [self.torch.from_numpy(feeds[n]) for n in self._names]  # views of the buffers, no copy
        try:
            with _POOL_LOCK:
                outs = self.method.execute(inputs)
        except RuntimeError as e:  # ExecuTorch's error code (its own log on stderr says which kernel refused)
            raise InputError(f"the ExecuTorch program refused this input ({str(e).splitlines()[0][:200]})") from None
        log_probs = outs[0].numpy()
        return log_probs.astype(np.float32, copy=False), [o.numpy() for o in outs[1:]] if advance else None

    def close(self):
        _OPEN.discard(self)
        self.method = self._program = None
