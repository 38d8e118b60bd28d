"""Peak memory of one side of a benchmark (resident set on the CPU, the allocator's peak on CUDA): what loading it
added plus the largest rise during a call, since both sides share one process and its high-water mark."""

from __future__ import annotations

import contextlib


def proc_status(*fields: str, pid="self") -> dict:
    """The named fields of /proc/PID/status (VmRSS, VmHWM, RssFile, ...: the kernel counts them in kB), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in fields}


def rss_bytes(pid="self") -> int:
    return proc_status("VmRSS", pid=pid)["VmRSS"]


class RssPeak:
    """The resident set's largest rise over a block, as the kernel counted it: no thread wakes inside a timed call."""

    def __enter__(self):
        with open("/proc/self/clear_refs", "w") as f:  # "5": VmHWM back to the current resident set (proc(5))
            f.write("5")
        self.start = rss_bytes()
        return self

    def __exit__(self, *exc):
        self.rise = max(0, proc_status("VmHWM")["VmHWM"] - self.start)


class CudaPeak:
    """torch's CUDA allocator peak over a block (torch backends on a GPU)."""

    def __init__(self, device):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        self.device, self.torch = device, torch

    def level(self) -> int:
        self.torch.cuda.synchronize(self.device)
        return self.torch.cuda.memory_allocated(self.device)

    def __enter__(self):
        self.start = self.level()
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        self.level()
        self.rise = max(0, self.torch.cuda.max_memory_allocated(self.device) - self.start)


class PeakMemory:
    """Accumulates one side's footprint: `load` once, then `call` around every measured call."""

    def __init__(self, cuda_device=None):
        self.cuda_device = cuda_device
        self.kind = "cuda_allocated" if cuda_device is not None else "rss"
        self.loaded = 0
        self.transient = 0

    def _meter(self):
        return CudaPeak(self.cuda_device) if self.cuda_device is not None else RssPeak()

    @contextlib.contextmanager
    def load(self):
        with self._meter() as meter:
            yield
        # what stays resident after loading; the load's own transient peak is not a cost of running
        level = meter.level() if self.cuda_device is not None else rss_bytes()
        self.loaded += max(0, level - meter.start)

    @contextlib.contextmanager
    def call(self):
        with self._meter() as meter:
            yield
        self.transient = max(self.transient, meter.rise)

    @property
    def peak(self) -> int:
        return self.loaded + self.transient
