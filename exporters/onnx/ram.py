"""How much memory an export and a runtime need: estimates from a model's shapes, checked before long work starts.

Every estimate is a sum of named terms (weights, recurrent state, the largest call's temporaries, the Python
process itself), so `txl-deploy info --memory` can show where the memory goes. The temporaries' factors were
measured on this project's 2-core reference machine (peak resident set size, ONNX Runtime 1.32, torch 2.13, the
WikiText-103-large shape: 1.14 GB of weights, mem_len 1600); `benchmarks/peak_ram.py` prints estimate and
measurement side by side on every run. No torch here: the ONNX Runtime side uses this module too.
"""

from __future__ import annotations

import ctypes
import functools
import os
from dataclasses import dataclass, field

from txl_deploy.contract.io_spec import r_table_size
from txl_deploy.errors import InputError
from txl_deploy.exporters.onnx.stream import verification_segments

# Resident set of the process before any model is loaded (interpreter, numpy, onnx, onnxruntime; torch for export).
BASE_EXPORT = 400_000_000
BASE_RUNTIME = 120_000_000
# torch.export and the ONNX translation hold about this fraction of the weights while tracing (measured 0.56).
TRACE_FRACTION = 0.6
# An output layer over P positions holds its log-probs twice (the cluster pieces and their concatenation), and the
# heap keeps some of what earlier calls freed: the large shape's verification measured 4.54 GB, estimated 4.57 GB.
LOG_PROB_COPIES = 2.6
# The least log-prob bytes one runtime call of a verification may return (log_prob_budget).
LOG_PROB_BUDGET_MIN = 256 * 1024 * 1024
# State dtype bytes of each precision's graph (docs/graph-contract.md, "Inputs and outputs").
STATE_BYTES = {"fp32": 4, "fp16": 2, "int8": 4, "int8-dynamic": 4, "int4": 4}


@dataclass
class Estimate:
    """An estimated peak: `terms` name what it is made of (bytes)."""

    what: str
    terms: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return int(sum(self.terms.values()))


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def state_bytes(cfg, mem_len: int, batch: int = 1, precision: str = "fp32") -> int:
    """The exported graphs' recurrent state: keys and values of every layer (plus the int64 counter)."""
    return batch * (cfg.memory_bytes_per_stream(mem_len, STATE_BYTES[precision])["kv_cache"] + 8)


def output_layer_bytes(cfg) -> int:
    """fp32 bytes of the adaptive softmax: cluster weights, biases, projections and the cluster logits."""
    ends = [0] + list(cfg.cutoffs) + [cfg.n_token]
    total = cfg.n_token  # biases
    for i, (lo, hi) in enumerate(zip(ends[:-1], ends[1:])):
        d = cfg.d_embed // cfg.div_val**i if cfg.div_val > 1 else cfg.d_embed
        total += (hi - lo) * d + (cfg.d_model * d if (cfg.div_val > 1 or cfg.d_model != cfg.d_embed) else 0)
    n_clusters = len(cfg.cutoffs)
    return 4 * (total + n_clusters * (cfg.d_embed + 1))


def log_prob_budget(weight_bytes: int) -> int:
    """The most log-prob bytes one runtime call of a verification returns: a third of the weights, at least
    256 MB. Bigger segments are computed in position blocks (exporters.verify.PositionBlocks; WikiText-103 large:
    3 blocks of 171 positions), which keeps a verification's peak under 4x the weights."""
    return max(LOG_PROB_BUDGET_MIN, int(weight_bytes) // 3)


def loaded_weight_bytes(loaded) -> int:
    """fp32 bytes of a LoadedModel's weights (fp16 checkpoints become fp32 when they are built)."""
    return 4 * sum(int(t.numel()) for t in loaded.state_dict.values() if t.is_floating_point())


def runtime_peak(cfg, weight_bytes: int, mem_len: int, max_segment: int, batch: int = 1,
                 precision: str = "fp32") -> Estimate:
    """TxlRuntime on ONNX Runtime (CPU): weights once (prepacked), the state, and a prefill piece's temporaries
    (a prefill asks the output layer for the last position only)."""
    q = min(max_segment, 512)
    return Estimate("runtime peak", {
        "weights": weight_bytes, "state": state_bytes(cfg, mem_len, batch, precision),
        "temporaries": cfg.activation_bytes(batch, q, mem_len), "process": BASE_RUNTIME})


def export_peaks(cfg, weight_bytes: int, mem_len: int, max_segment: int) -> dict[str, Estimate]:
    """Estimated peaks of `txl-deploy export` (fp32) without and with verification; each is the largest of its
    phases: tracing and writing, the reference pass, the ONNX Runtime pass (see exporters/onnx.py)."""

    table = r_table_size(cfg.clamp_len, mem_len, max_segment)
    folded = 4 * cfg.n_layer * cfg.n_head * cfg.d_head * (3 * cfg.d_model + table)
    write = Estimate("export --no-verify", {
        "weights": weight_bytes, "folded copies": folded, "tracing": TRACE_FRACTION * weight_bytes,
        "process": BASE_EXPORT})
    q = max(verification_segments(mem_len, max_segment))
    batch = 2
    reference = Estimate("reference pass", {
        "weights": weight_bytes, "memory": batch * cfg.memory_bytes_per_stream(mem_len)["hidden"],
        "temporaries": cfg.activation_bytes(batch, q, q + mem_len), "process": BASE_EXPORT})
    # One runtime call returns at most log_prob_budget's bytes; bigger segments run in blocks of
    # positions, the same call repeated without advancing the memory (exporters.verify.PositionBlocks).
    log_probs = batch * q * cfg.n_token * 4
    per_call = min(log_probs, log_prob_budget(weight_bytes))
    session = Estimate("ONNX Runtime pass", {
        "weights": weight_bytes, "output layer copy": output_layer_bytes(cfg),
        "state": state_bytes(cfg, mem_len, batch), "temporaries": cfg.activation_bytes(batch, q, mem_len),
        "log-probs": LOG_PROB_COPIES * per_call, "process": BASE_EXPORT})
    verified = max((write, reference, session), key=lambda e: e.total)
    return {"no_verify": write, "verify": Estimate(f"export (peak in the {verified.what})", dict(verified.terms))}


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_export_fits(peaks: dict[str, Estimate], verify: bool, available: int | None = None) -> None:
    """Refuse an export that would not fit in the memory available now, before it starts (InputError)."""
    available = available_bytes() if available is None else available
    if available is None:
        return
    need = peaks["verify" if verify else "no_verify"].total
    if need <= available:
        return
    have = format_bytes(available)
    if verify and peaks["no_verify"].total <= available:
        raise InputError(
            f"this export needs about {format_bytes(need)} of memory with its verification, but only {have} is "
            f"available: pass --no-verify (about {format_bytes(peaks['no_verify'].total)}; check the file later "
            "with `txl-deploy verify` on a larger machine), or free memory. --skip-memory-check runs it anyway.")
    raise InputError(
        f"this export needs about {format_bytes(need)} of memory{' with its verification' if verify else ''} "
        f"(about {format_bytes(peaks['no_verify'].total)} with --no-verify), but only {have} is available: free "
        "memory or use a larger machine. --skip-memory-check runs it anyway.")


MADV_DONTNEED = 4  # Linux's value on every architecture it runs on (asm-generic/mman-common.h)


def drop_file_pages(ranges) -> int:
    """Take the pages of the file mappings holding `ranges` ((address, bytes) pairs: the weights of a memory-mapped
    checkpoint) out of this process's resident set; returns the bytes of the mappings advised.

    A checkpoint read through a memory map stays resident once read: hashing it and copying its output weights into
    the cached step's layout touch every page, and one map serves every tensor, so freeing a tensor returns nothing.
    madvise(MADV_DONTNEED) on a file mapping whose pages are all still the file's (no page of a private mapping
    written, which /proc/self/smaps counts as Anonymous) only unmaps clean pages: a later read faults them in again
    from the page cache, with the same bytes. A mapping with a written page, or an anonymous one (a checkpoint read
    into memory), is left alone, since the advice would discard its contents. Linux only; elsewhere nothing is done."""
    madvise = _madvise()
    if madvise is None:
        return 0
    try:
        with open("/proc/self/smaps") as f:
            smaps = f.read().splitlines()
    except OSError:
        return 0
    clean = []  # (lo, hi) of file mappings whose every page is the file's
    current = None
    for line in smaps:
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's header line
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            current = [lo, hi, len(fields) >= 6 and fields[4] != "0", None]
            clean.append(current)
        elif current is not None and fields[:1] == ["Anonymous:"]:
            current[3] = int(fields[1])
    clean = [(lo, hi) for lo, hi, has_file, anonymous in clean if has_file and anonymous == 0]
    advised = set()
    for address, size in ranges:
        if size <= 0:
            continue
        for lo, hi in clean:
            if lo <= address and address + size <= hi:
                advised.add((lo, hi))
                break
    for lo, hi in advised:
        madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(MADV_DONTNEED))
    return sum(hi - lo for lo, hi in advised)


@functools.lru_cache(maxsize=None)
def _madvise():
    try:
        fn = ctypes.CDLL(None).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn if os.path.exists("/proc/self/smaps") else None


def ram_report(cfg, weight_bytes: int, mem_len: int, max_segment: int, batch: int, precision: str) -> dict:
    """Every estimate `txl-deploy info --memory` shows, as one JSON-ready dict (the export's only for an fp32 source)."""
    fp32_weights = weight_bytes if precision == "fp32" else None
    export = export_peaks(cfg, fp32_weights, mem_len, max_segment) if fp32_weights else None
    runtime = runtime_peak(cfg, weight_bytes, mem_len, max_segment, batch, precision)
    return {
        "mem_len": mem_len, "batch": batch, "max_segment": max_segment, "weight_bytes": weight_bytes,
        "export": {k: {"bytes": e.total, "what": e.what, "terms": e.terms} for k, e in export.items()} if export
        else None,
        "runtime": {"bytes": runtime.total, "terms": runtime.terms, "precision": precision},
        "state_per_precision": {p: state_bytes(cfg, mem_len, batch, p) for p in STATE_BYTES},
        "available_bytes": available_bytes(),
    }
