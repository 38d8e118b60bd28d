"""The floor a decode step cannot beat on a bandwidth-bound machine: the bytes it must read over one thread's
bandwidth, measured by a copy and a pure read in the rounds of the decode steps (`BandwidthProbe`). Why both, and
how to read the gap: docs/benchmarks.md ("The floor")."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import NamedTuple

import numpy as np

from txl_deploy.exporters.onnx.ram import output_layer_bytes

logger = logging.getLogger(__name__)


class Bandwidth(NamedTuple):
    copy: float  # bytes per second, read + write
    read: float  # bytes per second of a pure read
    read_cpu: float | None = None  # bytes per second of the read's CPU time on its thread (None: not measured)
    copy_cpu: float | None = None  # bytes read + written per second of the copy's CPU time on its thread


class BandwidthProbe:
    """The copy and read bandwidth at every call: the best of `repeats` over a buffer far larger than any cache,
    in wall time and in the calling thread's CPU time."""

    def __init__(self, nbytes: int = 256 * 2**20, repeats: int = 3):
        self.src = np.ones(max(1, nbytes // 8), dtype=np.float64)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the pages in
        self.repeats = repeats

    def __call__(self) -> Bandwidth:
        with blas_threads(1):
            return self._measure()

    def _measure(self) -> Bandwidth:
        copy = read = read_cpu = copy_cpu = float("inf")
        for _ in range(self.repeats):
            t0, c0 = time.perf_counter(), time.thread_time()
            np.copyto(self.dst, self.src)
            copy, copy_cpu = min(copy, time.perf_counter() - t0), min(copy_cpu, time.thread_time() - c0)
            for values in (self.src, self.src.view(np.float32)):  # OpenBLAS's ddot and sdot: the faster one counts
                half = values.size // 2
                t0, c0 = time.perf_counter(), time.thread_time()
                np.dot(values[:half], values[half:2 * half])  # reads both halves once, writes nothing
                read, read_cpu = min(read, time.perf_counter() - t0), min(read_cpu, time.thread_time() - c0)
        return Bandwidth(copy=2 * self.src.nbytes / copy, read=self.src.nbytes / read,
                         read_cpu=self.src.nbytes / max(read_cpu, 1e-9), copy_cpu=2 * self.src.nbytes / max(copy_cpu, 1e-9))


def blas_threads(n: int):
    """numpy's BLAS on `n` threads (OpenBLAS would split the read's dot product over every core)."""
    try:
        from threadpoolctl import threadpool_limits  # optional (the bench extra)
    except ImportError:
        logger.warning("threadpoolctl is not installed: numpy's products may run on several BLAS threads")
        return contextlib.nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


PRECISION_BYTES = {"fp32": (4, 4), "fp16": (2, 2), "int8": (1, 4), "int8-dynamic": (1, 4)}  # (weights, memory)


def decode_bytes(config, mem_len: int, batch: int, table_size: int | None = None, precision: str = "fp32") -> dict:
    """Bytes a decode step reads: weights (body, positional table, output layer; int8: a byte per matrix weight) and
    the memory of `batch` rows."""
    bytes_per_value, memory_bytes_per_value = PRECISION_BYTES.get(precision, (4, 4))

    D, H, Dh, Di, L = config.d_model, config.n_head, config.d_head, config.d_inner, config.n_layer
    T = table_size if table_size is not None else (min(config.clamp_len + 1, mem_len + 1) if config.clamp_len > 0
                                                   else mem_len + 1)
    per_layer = (3 * D * H * Dh + H * Dh * D  # qkv_net, o_net
                 + 2 * D * Di + Di + D  # pos_ff
                 + 4 * D  # two layer norms
                 + H * Dh * T + 2 * H * Dh)  # positional table (r_net applied once, at export), r_w_bias, r_r_bias
    out = output_layer_bytes(config) // 4  # its values: weights, biases, projections, the head's cluster rows
    weights = (L * per_layer + out + batch * D) * bytes_per_value  # + one embedding row per token
    memory = batch * L * 2 * H * Dh * mem_len * memory_bytes_per_value
    return {"weight_bytes": int(weights), "memory_bytes": int(memory), "output_layer_bytes": int(out * bytes_per_value),
            "precision": precision}


def floor(config, mem_len: int, batch: int, bandwidth: float, measured_ms: float, table_size=None,
          precision: str = "fp32", rounds=None, read_rounds=None) -> dict:
    """The floor of a decode step and the measured step's ratio to it (`gap`); with `rounds` [(bandwidth, decode
    median ms)], each round's own ratio (`gap_rounds`); with `read_rounds`, the same against the read bandwidth
    (`read_ms`, `read_gap`, `read_over_floor`)."""
    b = decode_bytes(config, mem_len, batch, table_size, precision)
    n_bytes = b["weight_bytes"] + b["memory_bytes"]
    floor_ms = n_bytes / bandwidth * 1e3
    out = {**b, "bandwidth_bytes_per_s": bandwidth, "floor_ms": floor_ms, "gap": measured_ms / floor_ms}
    if rounds:
        out["bandwidth_rounds"] = [float(bw) for bw, _ in rounds]
        out["gap_rounds"] = [float(ms / (n_bytes / bw * 1e3)) for bw, ms in rounds]
    if read_rounds:
        read = float(np.median(read_rounds))
        read_ms = n_bytes / read * 1e3
        out.update(read_bandwidth_rounds=[float(bw) for bw in read_rounds], read_bandwidth_bytes_per_s=read,
                   read_ms=read_ms, read_gap=measured_ms / read_ms, read_over_floor=read_ms / floor_ms)
    return out


