"""Timing one configuration (memory length, batch) of several runtimes side by side on one token stream, the sides
alternating (A B C, C B A, ...) with an optional probe taking its turn; peak memory from a separate untimed pass."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from txl_deploy.bench.peak_usage import PeakMemory
from txl_deploy.exporters.onnx.verify import kl_divergence


@dataclass
class Side:
    """One runtime under test: a label, a loader (called once, inside the memory meter) and its device."""

    label: str
    open: callable  # () -> TxlRuntime
    cuda_device: object = None  # a torch device for torch backends on CUDA, else None
    prefill_only: bool = False  # time the prefill only (no decode steps)
    decode_only: bool = False  # time the decode steps only (no prefill)
    rt: object = None
    path: str = None  # the file the backend ran (for the profiler)
    memory: PeakMemory = None
    full_state: dict = None
    decode_s: list = field(default_factory=list)
    prefill_s: list = field(default_factory=list)
    log_probs: list = field(default_factory=list)  # first repeat: prefill last position, then each decode step

    def sync(self):
        if self.cuda_device is not None:
            import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

            torch.cuda.synchronize(self.cuda_device)


@dataclass
class Stream:
    fill: np.ndarray  # [B, mem_len]: tokens that fill the memory
    decode: np.ndarray  # [B, gen_len]: tokens fed one at a time
    prompt: np.ndarray  # [B, prompt_len]: the prefill


def make_stream(n_token: int, batch: int, mem_len: int, gen_len: int, prompt_len: int, seed: int = 0) -> Stream:
    rng = np.random.default_rng(seed)
    return Stream(rng.integers(0, n_token, (batch, mem_len)), rng.integers(0, n_token, (batch, gen_len)),
                  rng.integers(0, n_token, (batch, prompt_len)))


def open_side(side: Side):
    side.memory = PeakMemory(side.cuda_device)
    with side.memory.load():
        side.rt = side.open()
    return side.rt


def _setup(side: Side, stream: Stream, warmup: int):
    if side.rt is None:
        open_side(side)
    if not side.prefill_only:
        with side.memory.load():
            side.rt.prefill(stream.fill)  # the memory is full from here on
            side.sync()
        side.full_state = side.rt.save_state()
        for t in range(min(warmup, stream.decode.shape[1])):
            side.rt.step(stream.decode[:, t:t + 1])
    if warmup and not side.decode_only:
        side.rt.reset()
        side.rt.prefill(stream.prompt)
    side.sync()


def _repeat(side: Side, stream: Stream, keep_log_probs: bool):
    rt = side.rt
    if not side.decode_only:
        rt.reset()
        t0 = time.perf_counter()
        lp = rt.prefill(stream.prompt)
        side.sync()
        side.prefill_s.append(time.perf_counter() - t0)
        if keep_log_probs:
            side.log_probs.append(np.array(lp, dtype=np.float32))
    if side.prefill_only:
        return
    rt.load_state(side.full_state)
    for t in range(stream.decode.shape[1]):
        t0 = time.perf_counter()
        lp = rt.step(stream.decode[:, t:t + 1])
        side.sync()
        side.decode_s.append(time.perf_counter() - t0)
        if keep_log_probs:
            side.log_probs.append(np.array(lp[:, 0], dtype=np.float32))


MEMORY_DECODE_STEPS = 8  # a decode step's footprint does not change from step to step once the memory is full


def _memory_pass(side: Side, stream: Stream):
    """The side's largest rise in memory over one prefill and a few decode steps, untimed."""
    rt = side.rt
    if not side.decode_only:
        rt.reset()
        with side.memory.call():
            rt.prefill(stream.prompt)
            side.sync()
    if side.prefill_only:
        return
    rt.load_state(side.full_state)
    with side.memory.call():
        for t in range(min(MEMORY_DECODE_STEPS, stream.decode.shape[1])):
            rt.step(stream.decode[:, t:t + 1])
        side.sync()


def interleaved(sides: dict, rounds: int) -> dict:
    """{name: [side(r) for each round r]}, the sides taking turns, the order reversed every other round (A B C,
    C B A, ...) so that a change in the machine's other load hits every side alike."""
    names, out = list(sides), {name: [] for name in sides}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name].append(sides[name](r))
    return out


def run_pair(sides: list[Side], stream: Stream, repeat: int, warmup: int, progress=None, probe=None) -> list:
    """Measure every side on `stream`, interleaved, then each side's memory; `progress(n)` hears of each phase.
    `probe()` takes a turn in every round (after the sides, then before); returns its results."""
    for side in sides:
        _setup(side, stream, warmup)
        if progress:
            progress(1)

    def turn(side):
        def run(r):
            _repeat(side, stream, keep_log_probs=(r == 0))
            if progress:
                progress(1)
        return run

    turns = {id(side): turn(side) for side in sides}
    probed = interleaved({**turns, "probe": lambda r: probe()} if probe is not None else turns, repeat)
    probed = probed.get("probe", [])
    for side in sides:
        _memory_pass(side, stream)
        side.path = getattr(side.rt.backend, "path", None)
        side.rt.close()
        side.rt = None
    return probed


def decode_rounds_ms(side: Side, repeat: int) -> list[float]:
    """The median decode step of each round (every round times the same number of steps), in ms."""
    n = len(side.decode_s) // repeat
    return [1e3 * float(np.median(side.decode_s[r * n:(r + 1) * n])) for r in range(repeat)]


def percentiles(samples_s) -> dict:
    ms = np.asarray(samples_s, dtype=np.float64) * 1e3
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)),
            "p99": float(np.percentile(ms, 99)), "mean": float(ms.mean()), "min": float(ms.min()), "n": int(ms.size)}


def summarise(side: Side, stream: Stream) -> dict:
    batch, prompt_len = stream.prompt.shape
    prefill_ms = float(np.median(side.prefill_s)) * 1e3 if side.prefill_s else None
    out = {
        "prefill_ms": prefill_ms,
        "prefill_tokens_per_s": batch * prompt_len * 1e3 / prefill_ms if prefill_ms else None,
        "peak_memory_bytes": int(side.memory.peak),
        "loaded_memory_bytes": int(side.memory.loaded),
        "memory_kind": side.memory.kind,
    }
    if side.prefill_only:
        return {"decode_ms": None, "decode_tokens_per_s": None, **out}
    decode = percentiles(side.decode_s)
    return {"decode_ms": decode, "decode_tokens_per_s": batch * 1e3 / decode["p50"], **out}


def parity(a: Side, b: Side) -> dict:
    """Max abs log-prob difference, mean KL(b || a) in nats per position (what judges a reduced precision) and
    top-1 agreement, over the positions both sides computed."""
    diffs, kl, agree, total = [], 0.0, 0, 0
    for x, y in zip(a.log_probs, b.log_probs):
        finite = np.isfinite(x) & np.isfinite(y)
        diffs.append(float(np.abs(x - y)[finite].max(initial=0.0)))
        diffs.append(0.0 if np.array_equal(np.isfinite(x), np.isfinite(y)) else float("inf"))
        # words `b` gives no probability add nothing; a word only `a` rules out makes the divergence infinite
        kl += kl_divergence(y, x)
        agree += int((x.argmax(-1) == y.argmax(-1)).sum())
        total += x.shape[0]
    return {"max_abs_diff": max(diffs, default=0.0), "kl_divergence": kl / max(total, 1),
            "top1_agreement": agree / max(total, 1), "positions": total}
