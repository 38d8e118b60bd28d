"""Peak memory of one side of a benchmark (resident set on the CPU, the allocator's peak on CUDA): what loading it
added plus the largest rise during a call, since both sides share one process and its high-water mark."""

from __future__ import annotations

import contextlib
import os
import resource
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:  # not Linux: the high-water mark is the best there is
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if os.uname().sysname == "Darwin" else peak * 1024


class RssSampler:
    """Samples the resident set size every `interval` seconds in a thread while a block runs."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self):
        self.start = rss_bytes()
        self.peak = self.start
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def rise(self) -> int:
        return max(0, self.peak - self.start)


class CudaPeak:
    """torch's CUDA allocator peak over a block (torch backends on a GPU)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        torch.cuda.synchronize(self.device)
        self.start = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        torch.cuda.synchronize(self.device)
        self.rise = max(0, torch.cuda.max_memory_allocated(self.device) - self.start)


class PeakMemory:
    """Accumulates one side's footprint: `load` once, then `call` around every timed call."""

    def __init__(self, cuda_device=None):
        self.cuda_device = cuda_device
        self.kind = "cuda_allocated" if cuda_device is not None else "rss"
        self.loaded = 0
        self.transient = 0

    def _meter(self):
        return CudaPeak(self.cuda_device) if self.cuda_device is not None else RssSampler()

    @contextlib.contextmanager
    def load(self):
        with self._meter() as meter:
            yield
        # what stays resident after loading; the load's own transient peak is not a cost of running
        if self.cuda_device is not None:
            import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

            level = torch.cuda.memory_allocated(self.cuda_device)
        else:
            level = rss_bytes()
        self.loaded += max(0, level - meter.start)

    @contextlib.contextmanager
    def call(self):
        with self._meter() as meter:
            yield
        self.transient = max(self.transient, meter.rise)

    @property
    def peak(self) -> int:
        return self.loaded + self.transient
