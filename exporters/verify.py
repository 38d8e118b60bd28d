"""Verification: an exported graph, run by its runtime, against the PyTorch eager reference on a stream.

The stream covers what can go wrong in a stateful export: batch > 1, a partly empty memory, decode steps (Q = 1),
prefill steps (Q > 1), and enough tokens for the ring buffer to wrap (more than mem_len), with the memory threaded
through every call on both sides.
"""

from __future__ import annotations

import numpy as np

# fp32 passes when every log-prob satisfies |got - ref| <= FP32_ATOL + FP32_RTOL * |ref| (numpy.allclose's rule):
# float32 rounding grows with the magnitude, and random or badly calibrated weights give log-probs of -100 and
# below whose last-bit differences exceed 1e-4 while the distribution is the same. Trained models sit far inside.
FP32_ATOL, FP32_RTOL = 1e-4, 1e-5
# Reduced precision is judged by the mean KL(reference || exported) per position, in nats (see precision.py).
REDUCED_KL = {"fp16": 1e-3, "int8": 0.1, "int8-dynamic": 0.1, "int4": 0.1}
COMPARE_CHUNK_FLOATS = 4 * 1024 * 1024  # log-probs compared at once in float64 (32 MB)


def verification_segments(mem_len: int, max_segment: int) -> list[int]:
    """Segment lengths: prefill into an empty memory, decode steps, a prefill that wraps the ring, decode again."""
    wrap = min(max_segment, mem_len + 2)
    segs = [min(3, max_segment), 1, 1, min(5, max_segment), wrap, 1, min(2, max_segment), 1]
    while sum(segs) <= mem_len + 1:  # make sure the ring wraps even when max_segment < mem_len
        segs.append(min(max_segment, mem_len))
    return segs


def compare_steps(step, reference_step, n_token: int, segments, batch: int = 2, seed: int = 0) -> dict:
    """Feed one random stream, segment by segment, to two stateful callables `tokens [B, Q] -> log_probs [B, Q, V]`
    (each threading its own memory) and measure how far `step` is from `reference_step`."""
    tokens = np.random.default_rng(seed).integers(0, n_token, size=(batch, sum(segments)), dtype=np.int64)
    pos, worst, ratio, kl, agree, total = 0, 0.0, 0.0, 0.0, 0, 0
    for q in segments:
        seg = tokens[:, pos:pos + q]
        ref_all, got_all = np.asarray(reference_step(seg)), np.asarray(step(seg))
        # float64 metrics a few positions at a time: a whole 512-token segment over a 267,735-word vocabulary
        # would be 1.1 GB per row in float64, several times over in temporaries
        chunk = max(1, COMPARE_CHUNK_FLOATS // max(1, ref_all.shape[-1]))
        for b in range(ref_all.shape[0]):
            for c in range(0, ref_all.shape[1], chunk):
                ref = ref_all[b, c:c + chunk].astype(np.float64)
                got = got_all[b, c:c + chunk].astype(np.float64)
                if not np.isfinite(got).all():  # overflow in reduced precision: no distance is meaningful any more
                    worst = ratio = kl = float("inf")
                elif np.isfinite(kl):
                    diff = np.abs(got - ref)
                    worst = max(worst, float(diff.max()))
                    ratio = max(ratio, float((diff / (FP32_ATOL + FP32_RTOL * np.abs(ref))).max()))
                    kl += float((np.exp(ref) * (ref - got)).sum())
                agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
        total += got_all.shape[0] * got_all.shape[1]
        pos += q
    return {"max_abs_diff": worst, "allclose_ratio": ratio, "kl_divergence": kl / total,
            "top1_agreement": agree / total, "tokens": total, "batch": batch, "segments": list(segments)}


def compare_stream(runtime, reference_model, batch: int = 2, seed: int = 0, segments=None) -> dict:
    """Feed the same random stream to `runtime` (a TxlRuntime) and `reference_model` (MemTransformerLM)."""
    import torch

    segments = segments or verification_segments(runtime.mem_len, runtime.backend.max_segment)
    state = {"mems": None}

    @torch.no_grad()
    def reference_step(seg):
        log_probs, state["mems"] = reference_model(torch.from_numpy(seg), state["mems"])
        return log_probs.numpy()

    runtime.reset()
    try:
        return compare_steps(runtime.step, reference_step, runtime.config.n_token, segments, batch, seed)
    finally:
        runtime.reset()


def judge(report: dict, precision: str, tolerance: float | None = None) -> dict:
    """Add `passed` and a readable `criterion` to a compare_stream report.

    fp32: allclose with atol (default 1e-4, or `tolerance`) and rtol 1e-5. Reduced precision: mean KL divergence
    from the fp32 reference (default per precision, or `tolerance`)."""
    if precision == "fp32":
        atol = FP32_ATOL if tolerance is None else tolerance
        ratio = report["allclose_ratio"] * FP32_ATOL / atol
        report.update(tolerance=atol, passed=bool(ratio <= 1.0),
                      criterion=f"|diff| <= {atol:g} + {FP32_RTOL:g} x |log-prob|")
    else:
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


def verify_export(onnx_path, reference_model, tolerance: float | None = None, providers=None, log=print,
                  threads: int | None = None) -> dict:
    """Run the exported file in ONNX Runtime against the reference; returns the report (passed or not)."""
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(onnx_path, providers=providers, threads=threads) as rt:
        report = judge(compare_stream(rt, reference_model), rt.backend.precision, tolerance)
    log("  " + describe(report))
    return report
