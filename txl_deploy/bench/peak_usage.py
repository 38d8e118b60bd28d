"""Peak memory of one side of a benchmark: resident set size on the CPU, the allocator's peak on CUDA.

A side's peak is what loading it added to the process plus the largest transient rise while it ran a call
(`peak during the call - level just before it`). Both sides live in one process (they are interleaved), so the
process-wide high-water mark would charge one side with the other's weights; this split does not.
"""

from __future__ import annotations

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

    def load(self):
        return _Track(self, "loaded")

    def call(self):
        return _Track(self, "transient")

    @property
    def peak(self) -> int:
        return self.loaded + self.transient


class _Track:
    def __init__(self, owner: PeakMemory, field: str):
        self.owner, self.field = owner, field

    def __enter__(self):
        self.meter = self.owner._meter().__enter__()
        return self

    def __exit__(self, *exc):
        self.meter.__exit__(*exc)
        if self.field == "loaded":
            # what stays resident after loading; the load's own transient peak is not a cost of running
            self.owner.loaded += max(0, self._end_level() - self.meter.start)
        else:
            self.owner.transient = max(self.owner.transient, self.meter.rise)

    def _end_level(self) -> int:
        if self.owner.cuda_device is not None:
            import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

            return torch.cuda.memory_allocated(self.owner.cuda_device)
        return rss_bytes()
