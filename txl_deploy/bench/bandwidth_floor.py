"""The floor a decode step cannot beat on a bandwidth-bound machine: the bytes it must read over the bandwidth.

A decode step (Q = 1, full memory) reads every weight it multiplies by once, and the keys and values of every
memory slot of every layer. At batch 1 each weight is used for one multiply-add, so no cache helps: the step
is a stream over (weight bytes + memory bytes). `floor_ms = bytes / bandwidth`, with the bandwidth measured
by a numpy copy (STREAM-style: bytes read + bytes written over the time, one thread).

A copy counts two bytes moved per byte it reads, and one thread's read rate can differ from its copy rate
either way, while a decode step only reads. So the probe also times a pure read of the same buffer (numpy's dot
product of its two halves in float64 and in float32: OpenBLAS's streaming kernels, the fastest reads of the numpy
kernels tried here), and the report gives the step against that read of its bytes too. Where the read is faster
than the copy floor, the copy floor overstates what the step must take; where it is slower, the copy floor is out
of one thread's reach.

The bandwidth a shared machine gives one thread moves with the other jobs' load, so it is measured in the same
rounds as the decode steps it is compared with (`BandwidthProbe`, a turn of `timing.run_pair`): each round's
decode median is set against that round's bandwidth, and a floor ratio compares like with like.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import NamedTuple

import numpy as np
import onnx
from onnx import numpy_helper

from txl_deploy.contract.clusters import pieces
from txl_deploy.contract.metadata import read_onnx_info

logger = logging.getLogger(__name__)


class Bandwidth(NamedTuple):
    copy: float  # bytes per second, read + write
    read: float  # bytes per second of a pure read
    read_cpu: float | None = None  # bytes per second of the read's CPU time on its thread (None: not measured)
    copy_cpu: float | None = None  # bytes read + written per second of the copy's CPU time on its thread


class BandwidthProbe:
    """The copy and the read bandwidth, measured again at every call on buffers allocated (and faulted in) once:
    the best of `repeats` copies of `nbytes` (far larger than any cache) and the best of `repeats` reads of the
    same buffer, so a call takes about a tenth of a second. The read is also timed in CPU time of the calling
    thread (`read_cpu`): on a machine with more runnable threads than cores, wall time includes the time a thread
    waits for a core, and the CPU time does not."""

    def __init__(self, nbytes: int = 256 * 2**20, repeats: int = 3):
        self.src = np.ones(max(1, nbytes // 8), dtype=np.float64)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the pages in
        self.repeats = repeats

    def __call__(self) -> Bandwidth:
        with _one_blas_thread():
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


def _one_blas_thread():
    """A context in which numpy's BLAS runs on one thread: OpenBLAS splits a long dot product over every core, which
    makes the read a several-thread read (and hides its other threads' work from the caller's CPU clock)."""
    try:
        from threadpoolctl import threadpool_limits  # optional (the bench extra)
    except ImportError:
        logger.warning("threadpoolctl is not installed: the plain read may run on several BLAS threads")
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


PRECISION_BYTES = {"fp32": (4, 4), "fp16": (2, 2), "int8": (1, 4), "int8-dynamic": (1, 4)}  # (weights, memory)


def decode_bytes(config, mem_len: int, batch: int, table_size: int | None = None, precision: str = "fp32") -> dict:
    """Bytes a decode step reads: weights (body, positional table, output layer) and the memory of `batch` rows.

    int8 graphs count one byte per matrix weight (biases, norms and tables are few bytes either way)."""
    bytes_per_value, memory_bytes_per_value = PRECISION_BYTES.get(precision, (4, 4))

    D, H, Dh, Di, L = config.d_model, config.n_head, config.d_head, config.d_inner, config.n_layer
    T = table_size if table_size is not None else (min(config.clamp_len + 1, mem_len + 1) if config.clamp_len > 0
                                                   else mem_len + 1)
    per_layer = (3 * D * H * Dh + H * Dh * D  # qkv_net, o_net
                 + 2 * D * Di + Di + D  # pos_ff
                 + 4 * D  # two layer norms
                 + H * Dh * T + 2 * H * Dh)  # positional table (r_net applied once, at export), r_w_bias, r_r_bias
    out = 0
    d_embed = config.d_embed
    if config.n_clusters:
        out += config.n_clusters * (d_embed + 1)
    for i, (lo, hi) in enumerate(pieces(config.cutoffs, config.n_token)):
        d_i = d_embed // config.div_val**i if config.div_val > 1 else d_embed
        out += (hi - lo) * (d_i + 1)
        if config.div_val > 1 or D != d_embed:
            out += D * d_i
    weights = (L * per_layer + out + batch * D) * bytes_per_value  # + one embedding row per token
    memory = batch * L * 2 * H * Dh * mem_len * memory_bytes_per_value
    return {"weight_bytes": int(weights), "memory_bytes": int(memory), "output_layer_bytes": int(out * bytes_per_value),
            "precision": precision}


def floor(config, mem_len: int, batch: int, bandwidth: float, measured_ms: float, table_size=None,
          precision: str = "fp32", rounds=None, read_rounds=None) -> dict:
    """The floor of a decode step and the measured step's ratio to it (`gap`).

    rounds: [(bandwidth, decode median ms)] of each round when the bandwidth was measured in the rounds of the
    decode steps; `bandwidth` is then their median, and `gap_rounds` holds each round's own ratio.
    read_rounds: the read bandwidth of the same rounds; adds `read_ms` (the step's bytes over their median), the
    step's ratio to it (`read_gap`) and where a pure read stands against the copy floor (`read_over_floor`)."""
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


ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 10: 2, 11: 8}  # onnx TensorProto data types: FLOAT, UINT8, INT8, ...


def graph_step_bytes(path) -> dict:
    """What one decode step (batch 1, memory full) reads, by kind, in bytes, counted from the graph: the constants
    of the weight products (MatMul by a 2-D constant; MatMulNBits' 4-bit weights, scales and zero points), the
    positional tables (MatMul by a 3-D constant), and the memory's keys and values. A constant stored in fp16 and
    cast when the session loads counts as the fp32 the kernels read; one reached through a Transpose or Reshape (a
    tied output layer) counts as the constant ONNX Runtime folds it into. At batch 1 every byte is read once per
    step, so fp32 bytes / int4 bytes bounds the speed-up a bandwidth-bound step can get."""
    graph = onnx.load(str(path)).graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def constant(name):
        """(dims, bytes per element as the kernel reads it) of a constant input, or None for an activation."""
        if name in inits:
            t = inits[name]
            return list(t.dims), ELEMENT_BYTES.get(t.data_type, 4)
        node = producer.get(name)
        if node is None or node.op_type not in ("Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Slice",
                                                "Concat"):
            return None
        srcs = [constant(i) for i in node.input[:1 if node.op_type != "Concat" else None]]
        if any(c is None for c in srcs):
            return None
        dims, size = srcs[0]
        if node.op_type == "Cast":
            return dims, ELEMENT_BYTES.get(next(a.i for a in node.attribute if a.name == "to"), 4)
        if node.op_type == "Concat":  # the pieces of an adaptive-softmax head: their elements, in one block
            return [sum(int(np.prod(d)) for d, _ in srcs)], size
        if node.op_type == "Slice":  # the rows of a cluster, cut from the tied embedding
            starts, ends = (numpy_helper.to_array(inits[i]) for i in node.input[1:3])
            axes = numpy_helper.to_array(inits[node.input[3]]) if len(node.input) > 3 else range(len(starts))
            dims = list(dims)
            for axis, a, b in zip(axes, starts, ends):
                dims[axis] = max(0, min(int(b), dims[axis]) - min(int(a), dims[axis]))
        return dims, size

    out = {"weights": 0, "positional_tables": 0}
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            inputs = node.input[1:]
        elif node.op_type in ("MatMul", "Gemm"):
            inputs = node.input
        else:
            continue
        for name in inputs:
            c = constant(name) if name else None
            if c is not None:
                kind = "positional_tables" if node.op_type == "MatMul" and len(c[0]) == 3 else "weights"
                out[kind] += int(np.prod(c[0])) * c[1]
    info = read_onnx_info(path)
    cfg = info.config
    state_bytes = 2 if info.precision == "fp16" else 4
    out["memory"] = 2 * cfg.n_layer * cfg.n_head * cfg.d_head * info.mem_len * state_bytes
    out["total"] = out["weights"] + out["positional_tables"] + out["memory"]
    return out


def interleaved_efficiency(steps: dict, n_bytes: dict, probe: BandwidthProbe, rounds: int, steps_per_round: int) -> dict:
    """Each side's decode step against the copy floor and the plain read of the bytes it reads, in one run.

    steps: {side: a callable running one decode step}; n_bytes: {side: bytes that step reads}. A round times
    `steps_per_round` steps of every side (the order alternating from round to round), then the probe's copy and
    read; each round's step median is set against that round's bandwidth (`efficiency`). Every step is timed in
    wall time and in CPU time of the calling thread (one intra-op thread runs the graph on it)."""
    step_rounds = {side: [] for side in steps}
    cpu_rounds = {side: [] for side in steps}
    bandwidths = []
    for k in range(rounds):
        order = list(steps.items()) if k % 2 == 0 else list(steps.items())[::-1]
        for side, step in order:
            times, cpu = [], []
            for _ in range(steps_per_round):
                t0, c0 = time.perf_counter(), time.thread_time()
                step()
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            step_rounds[side].append(1e3 * float(np.median(times)))
            cpu_rounds[side].append(1e3 * float(np.median(cpu)))
        bandwidths.append(probe())
    return {side: efficiency(n_bytes[side], step_rounds[side], bandwidths, cpu_rounds[side]) for side in steps}


def efficiency(n_bytes: int, step_ms_rounds, bandwidths, step_cpu_ms_rounds=None) -> dict:
    """The step's median against `n_bytes` read at each round's bandwidth (`Bandwidth` per round): `read_ms` (the
    bytes over the median plain-read rate), `copy_ms` (the copy floor: the bytes over the median copy rate, which
    counts a byte read and a byte written), and the medians of each round's own ratios (`over_read`,
    `over_copy`), so a round slowed by another job compares its step with its own bandwidth.

    step_cpu_ms_rounds: the same rounds' step medians in CPU time; adds `step_cpu_ms`, `read_cpu_ms` (the bytes over
    the read's CPU-time rate), `copy_cpu_ms` and `over_read_cpu`, `over_copy_cpu`: the step against the read and
    the copy floor with the time either side waited for a core left out."""
    step_ms_rounds = [float(ms) for ms in step_ms_rounds]
    read = [float(bw.read) for bw in bandwidths]
    copy = [float(bw.copy) for bw in bandwidths]
    out = {"bytes": int(n_bytes), "step_ms": float(np.median(step_ms_rounds)), "step_ms_rounds": step_ms_rounds,
           "read_bytes_per_s": float(np.median(read)), "copy_bytes_per_s": float(np.median(copy)),
           "read_ms": n_bytes / float(np.median(read)) * 1e3, "copy_ms": n_bytes / float(np.median(copy)) * 1e3,
           "over_read": float(np.median([ms / (n_bytes / bw * 1e3) for ms, bw in zip(step_ms_rounds, read)])),
           "over_copy": float(np.median([ms / (n_bytes / bw * 1e3) for ms, bw in zip(step_ms_rounds, copy)]))}
    read_cpu, copy_cpu = [bw.read_cpu for bw in bandwidths], [bw.copy_cpu for bw in bandwidths]
    if step_cpu_ms_rounds is None:
        return out
    cpu = [float(ms) for ms in step_cpu_ms_rounds]
    out.update(step_cpu_ms=float(np.median(cpu)), step_cpu_ms_rounds=cpu)
    if all(r is not None for r in read_cpu + copy_cpu):
        out.update(read_cpu_bytes_per_s=float(np.median(read_cpu)), copy_cpu_bytes_per_s=float(np.median(copy_cpu)),
                   read_cpu_ms=n_bytes / float(np.median(read_cpu)) * 1e3,
                   copy_cpu_ms=n_bytes / float(np.median(copy_cpu)) * 1e3,
                   over_read_cpu=float(np.median([ms / (n_bytes / bw * 1e3) for ms, bw in zip(cpu, read_cpu)])),
                   over_copy_cpu=float(np.median([ms / (n_bytes / bw * 1e3) for ms, bw in zip(cpu, copy_cpu)])))
    return out
