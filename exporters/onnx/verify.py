"""Verification: an exported graph, run by its runtime, against the PyTorch eager reference on a stream.

The stream covers what can go wrong in a stateful export: batch > 1, a partly empty memory, decode steps (Q = 1),
prefill steps (Q > 1), and enough tokens for the ring buffer to wrap (more than mem_len), with the memory threaded
through every call on both sides.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from txl_deploy.checkpoints import load_model
from txl_deploy.contract.metadata import read_onnx_info
from txl_deploy.contract.onnx_file import external_data, weight_file_bytes
from txl_deploy.errors import InputError
from txl_deploy.exporters.onnx.ram import log_prob_budget
from txl_deploy.exporters.onnx.stream import stream_tokens, verification_segments
from txl_deploy.heap import return_free_memory
from txl_deploy.runtimes import TxlRuntime

logger = logging.getLogger(__name__)

# fp32 passes when every log-prob satisfies |got - ref| <= FP32_ATOL + FP32_RTOL * |ref| (numpy.allclose's rule):
# float32 rounding grows with the magnitude, and random or badly calibrated weights give log-probs of -100 and
# below whose last-bit differences exceed 1e-4 while the distribution is the same. Trained models sit far inside.
FP32_ATOL, FP32_RTOL = 1e-4, 1e-5
# Reduced precision is judged by the mean KL(reference || exported) per position, in nats (see exporters/precision).
REDUCED_KL = {"fp16": 1e-3, "int8": 0.1, "int8-dynamic": 0.1, "int4": 0.1}
COMPARE_CHUNK_FLOATS = 4 * 1024 * 1024  # log-probs compared at once (16 MB in float32)


def compare_steps(step, reference_step, n_token: int, segments, batch: int = 2, seed: int = 0) -> dict:
    """Feed one random stream, segment by segment, to two stateful callables `tokens [B, Q] -> log_probs [B, Q, V]`
    (each threading its own memory) and measure how far `step` is from `reference_step`.

    Either side may return a lazy result instead of the whole [B, Q, V] block, so that neither is ever held at once:
    `reference_step` a callable `(row, lo, hi) -> log_probs [hi - lo, V]` (`ReferenceStream`), `step` a callable
    `(lo, hi) -> log_probs [B, hi - lo, V]` with a `block` attribute, asked for its blocks in order
    (`PositionBlocks`).

    The report: `max_abs_diff`, the largest |got - ref| of any log-prob; `tolerance_used`, the largest
    |got - ref| / (FP32_ATOL + FP32_RTOL * |ref|), the share of fp32's tolerance the worst log-prob uses (fp32
    passes at <= 1); `kl_divergence`, the mean KL(ref || got) per position in nats; `top1_agreement`."""
    tokens = stream_tokens(n_token, segments, batch, seed)
    pos, worst, ratio, kl, agree, total = 0, 0.0, 0.0, 0.0, 0, 0
    for q in segments:
        seg = tokens[:, pos:pos + q]
        ref_all = reference_step(seg)
        if not callable(ref_all):
            ref_all = _rows_of(np.asarray(ref_all))
        got_all = step(seg)
        if not callable(got_all):
            got_all = _blocks_of(np.asarray(got_all))
        for start in range(0, q, got_all.block):
            block = got_all(start, min(q, start + got_all.block))
            # Metrics a few positions at a time, in float32 with float64 sums: a whole 512-token segment over a
            # 267,735-word vocabulary is 1.1 GB per row in float32. The difference of two nearby float32 values is
            # exact (Sterbenz), so |got - ref| and the tolerance used are what float64 would give.
            chunk = max(1, COMPARE_CHUNK_FLOATS // max(1, block.shape[-1]))
            for b in range(block.shape[0]):
                for c in range(0, block.shape[1], chunk):
                    got = np.asarray(block[b, c:c + chunk], dtype=np.float32)
                    ref = np.asarray(ref_all(b, start + c, start + c + got.shape[0]), dtype=np.float32)
                    if not np.isfinite(got).all():  # overflow in reduced precision: no distance means anything
                        worst = ratio = kl = float("inf")
                    elif np.isfinite(kl):
                        diff = np.abs(ref - got)
                        worst = max(worst, float(diff.max()))
                        ratio = max(ratio, float((diff / (FP32_ATOL + FP32_RTOL * np.abs(ref))).max()))
                        kl += kl_divergence(ref, got)
                    agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += block.shape[0] * block.shape[1]
            del block
            return_free_memory()  # each call's temporaries, or the heap fragments over the stream (exporters/onnx/ram.py)
        pos += q
        del got_all, ref_all
    return {"max_abs_diff": worst, "tolerance_used": ratio, "kl_divergence": kl / total,
            "top1_agreement": agree / total, "tokens": total, "batch": batch, "segments": list(segments)}


def _log_normalized(log_probs: np.ndarray) -> np.ndarray:
    x = log_probs.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return x - (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))


def kl_divergence(ref: np.ndarray, got: np.ndarray) -> float:
    """KL(ref || got) in nats, summed over positions (the last axis is the vocabulary).

    Both sides are renormalised in float64 first: float32 log-probs sum to 1 only within rounding, and that alone
    makes the plain sum of p * (log p - log q) come out negative (-4e-8 nats) when the two are nearly equal. Each
    position's divergence is then clipped at 0 for the float64 rounding that is left."""
    p_log, q_log = _log_normalized(ref), _log_normalized(got)
    p = np.exp(p_log)
    with np.errstate(invalid="ignore"):  # -inf - -inf where both rule a symbol out: dropped just below
        terms = np.where(p > 0, p * (p_log - q_log), 0.0)  # 0 * log 0 = 0 where ref rules a symbol out
    return float(np.maximum(terms.sum(axis=-1), 0.0).sum())


def _blocks_of(log_probs: np.ndarray):
    def get(lo, hi):
        return log_probs[:, lo:hi]

    get.block = max(1, log_probs.shape[1])
    return get


class PositionBlocks:
    """A runtime's log-probs for one segment, computed a block of positions per call: `(lo, hi) -> [B, hi - lo, V]`.

    Every call runs the whole segment from the same memory and asks the graph's output layer for one block of
    `out_positions`; only the last block's call advances the memory, so the stream goes on exactly as after one
    call. Costs one more pass of the body per extra block, saves [B, Q, V] log-probs and the graph's temporaries
    for them (2.3 GB for a 512-token batch-2 segment of WikiText-103 large). The calls before the last leave the
    memory alone (`step(advance=False)`); a backend that cannot do that gets its memory back from a snapshot."""

    def __init__(self, runtime, seg, block: int):
        self.runtime, self.seg, self.block = runtime, seg, block
        self.snapshot = None

    def __call__(self, lo, hi):
        positions = np.arange(lo, hi)
        if hi >= self.seg.shape[1]:
            if self.snapshot is not None:
                self.runtime.load_state(self.snapshot)
            return self.runtime.step(self.seg, positions=positions)
        try:
            return self.runtime.step(self.seg, positions=positions, advance=False)
        except InputError:
            pass
        if self.runtime.batch_size is None:  # nothing fed yet: an empty memory is the snapshot
            out = self.runtime.step(self.seg, positions=positions)
            self.runtime.reset()
            return out
        if self.snapshot is None:
            self.snapshot = self.runtime.save_state()
        # a copy for every call: the incremental backends write the ring in place
        self.runtime.load_state({k: np.copy(v) for k, v in self.snapshot.items()})
        return self.runtime.step(self.seg, positions=positions)


def runtime_step(runtime, log_prob_bytes: int | None = None):
    """`runtime.step` for compare_steps, in PositionBlocks when a segment's [B, Q, V] log-probs exceed
    `log_prob_bytes` (None: never)."""
    def step(seg):
        B, Q = seg.shape
        per_call = Q if log_prob_bytes is None else max(1, int(log_prob_bytes) // (4 * B * runtime.n_token))
        if per_call >= Q or Q > runtime.backend.max_segment:
            return runtime.step(seg)
        blocks = -(-Q // per_call)
        return PositionBlocks(runtime, seg, -(-Q // blocks))  # equal blocks: 3 x 171, not 177 + 177 + 158

    return step


def _rows_of(log_probs: np.ndarray):
    return lambda b, lo, hi: log_probs[b, lo:hi]


class ReferenceStream:
    """The PyTorch reference's side of a stream comparison, computed in two phases so that the reference and the
    runtime under test never need their weights and full log-probabilities in memory at once.

    Phase one (here, at construction): the reference body runs over the whole stream with its memory threaded,
    keeping only each segment's last hidden states (4 bytes x d_model per position). Afterwards only the output
    layer (`crit`) is needed, so a caller that drops its own references to the model frees the body's weights
    before the runtime loads. Phase two (`step`): the output layer is applied to those hidden states a block of
    positions at a time, as the comparison asks for them. The numbers are the reference's own: the same body and
    the same output layer, applied to fewer positions per call.
    """

    BLOCK = 64  # positions per output-layer call: [64, 267735] log-probs are 69 MB, its temporaries a few times that

    def __init__(self, model, segments, batch: int = 2, seed: int = 0):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        self.n_token, self.segments, self.batch, self.seed = model.cfg.n_token, list(segments), batch, seed
        tokens = stream_tokens(self.n_token, self.segments, batch, seed)
        self.hidden, mems, pos = [], None, 0
        with torch.no_grad():
            for q in self.segments:
                h, mems = model.body(torch.from_numpy(tokens[:, pos:pos + q]), mems)
                self.hidden.append(h)
                pos += q
        self.crit = _detached_copy(model.crit)
        self._next = 0

    def step(self, seg):
        h = self.hidden[self._next]
        if tuple(seg.shape) != tuple(h.shape[:2]):
            raise ValueError(f"segment {self._next} of the stream is {tuple(h.shape[:2])}, got {tuple(seg.shape)}")
        self._next += 1
        return _OutputBlocks(self.crit, h, self.BLOCK)

    def compare(self, step) -> dict:
        """Feed the stream to `step` (a runtime's step or `runtime_step`, its memory reset) and compare."""
        self._next = 0
        return compare_steps(step, self.step, self.n_token, self.segments, self.batch, self.seed)


def _detached_copy(crit):
    """The output layer with tensors of its own. Loaded tensors are often views of one mapping of the checkpoint
    file (safetensors, torch.load(mmap=True)); keeping any of them keeps the whole file resident."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    from txl_deploy.model.mem_transformer import ProjectedAdaptiveLogSoftmax  # imports torch

    with torch.device("meta"):
        copy = ProjectedAdaptiveLogSoftmax(crit.cfg)
    copy.load_state_dict({k: v.detach().clone() for k, v in crit.state_dict().items()}, assign=True)
    return copy.eval()


class _OutputBlocks:
    """`(row, lo, hi) -> reference log-probs`, computing the output layer one block of positions at a time."""

    def __init__(self, crit, hidden, block: int):
        self.crit, self.hidden, self.block = crit, hidden, block
        self.key, self.values = None, None

    def __call__(self, b, lo, hi):
        hi = min(hi, self.hidden.shape[1])
        parts = []
        while lo < hi:  # compare_steps asks for chunks that may span blocks
            start = lo - lo % self.block
            end = min(hi, start + self.block)
            parts.append(self._block(b, start)[lo - start:end - start])
            lo = end
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _block(self, b, start):
        import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

        if self.key != (b, start):
            with torch.no_grad():
                self.values = self.crit(self.hidden[b, start:start + self.block]).numpy()
            self.key = (b, start)
        return self.values


def compare_stream(runtime, reference, batch: int = 2, seed: int = 0, segments=None,
                   log_prob_bytes: int | None = None) -> dict:
    """Feed the same random stream to `runtime` (a TxlRuntime) and `reference` (a MemTransformerLM, or a
    ReferenceStream already computed for this runtime's stream). `log_prob_bytes`: the most log-probs one runtime
    call may return (see runtime_step)."""
    if not isinstance(reference, ReferenceStream):
        segments = segments or verification_segments(runtime.mem_len, runtime.backend.max_segment)
        reference = ReferenceStream(reference, segments, batch, seed)
    runtime.reset()
    try:
        return reference.compare(runtime_step(runtime, log_prob_bytes))
    finally:
        runtime.reset()


def judge(report: dict, precision: str, tolerance: float | None = None) -> dict:
    """Add `passed` and a readable `criterion` to a compare_stream report.

    fp32: allclose with atol (default 1e-4, or `tolerance`) and rtol 1e-5. Reduced precision: mean KL divergence
    from the fp32 reference (default per precision, or `tolerance`)."""
    if precision == "fp32":
        atol = FP32_ATOL if tolerance is None else tolerance
        ratio = report["tolerance_used"] * FP32_ATOL / atol
        report.update(tolerance=atol, tolerance_used=ratio, passed=bool(ratio <= 1.0),
                      criterion=f"|diff| <= {atol:g} + {FP32_RTOL:g} x |log-prob|")
    else:
        report.pop("tolerance_used", None)  # fp32's rule, which a reduced graph is not judged by
        limit = REDUCED_KL.get(precision, 0.1) if tolerance is None else tolerance
        report.update(tolerance=limit, passed=bool(report["kl_divergence"] <= limit),
                      criterion=f"mean KL divergence <= {limit:g} nats")
    report["precision"] = precision
    return report


def describe(report: dict) -> str:
    return (f"max abs difference {report['max_abs_diff']:.3g}, KL {report['kl_divergence']:.2g} nats, top-1 "
            f"agreement {report['top1_agreement']:.4f} over {report['tokens']} positions (batch {report['batch']}, "
            f"segments {report['segments']}); tolerance: {report['criterion']} -> "
            f"{'OK' if report['passed'] else 'MISMATCH'}")


def verify_runtime(rt, onnx_path, reference, tolerance: float | None = None) -> dict:
    """Run `rt` (a TxlRuntime of the exported file at `onnx_path`) against the reference (a MemTransformerLM or a
    ReferenceStream of this file's stream, `verification_segments`); returns the report (passed or not)."""
    budget = log_prob_budget(weight_file_bytes(onnx_path))
    report = judge(compare_stream(rt, reference, log_prob_bytes=budget), rt.backend.precision, tolerance)
    logger.info("  " + describe(report))
    return report


def verify_file(model, checkpoint, tolerance: float | None = None, batch: int = 2, seed: int = 0, providers=None,
                threads: int | None = None) -> dict:
    """`txl-deploy verify`: an exported graph or engine against the PyTorch reference built from `checkpoint`, on
    the verification stream; returns the judged report (`passed` or not).

    The reference pass runs before the runtime loads, and only its output layer is kept for the comparison: the two
    models' weights are never in memory together (ReferenceStream). `threads` applies to both sides."""
    import torch  # the reference side

    if threads:
        torch.set_num_threads(threads)
    load = dict(providers=providers, threads=threads)
    if Path(model).suffix == ".onnx":
        info = read_onnx_info(model)
        external_data(model)  # refused before the reference pass, not after it
        config, mem_len, max_segment = info.config, info.mem_len, info.max_segment
    else:  # an engine describes itself once loaded
        with TxlRuntime.load(model, **load) as rt:
            config, mem_len, max_segment = rt.config, rt.mem_len, rt.backend.max_segment
    reference = load_model(checkpoint).build().reset_length(mem_len)
    if reference.cfg.replace(mem_len=0) != config.replace(mem_len=0):
        raise InputError(f"{model} was not exported from {checkpoint}: their configs differ")
    stream = ReferenceStream(reference, verification_segments(mem_len, max_segment), batch, seed)
    del reference
    with TxlRuntime.load(model, **load) as rt:
        budget = log_prob_budget(weight_file_bytes(model))
        report = judge(compare_stream(rt, stream, log_prob_bytes=budget), rt.backend.precision, tolerance)
    report["batch"] = batch
    return report
