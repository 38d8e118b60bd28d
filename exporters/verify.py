"""Verification: an exported graph, run by its runtime, against the PyTorch eager reference on a stream.

The stream covers what can go wrong in a stateful export: batch > 1, a partly empty memory, decode steps (Q = 1),
prefill steps (Q > 1), and enough tokens for the ring buffer to wrap (more than mem_len), with the memory threaded
through every call on both sides.
"""

from __future__ import annotations

import numpy as np

DEFAULT_TOLERANCE = {"fp32": 1e-4, "fp16": 5e-2, "int8": 0.5, "int8-dynamic": 0.5}


def verification_segments(mem_len: int, max_segment: int) -> list[int]:
    """Segment lengths: prefill into an empty memory, decode steps, a prefill that wraps the ring, decode again."""
    wrap = min(max_segment, mem_len + 2)
    segs = [min(3, max_segment), 1, 1, min(5, max_segment), wrap, 1, min(2, max_segment), 1]
    while sum(segs) <= mem_len + 1:  # make sure the ring wraps even when max_segment < mem_len
        segs.append(min(max_segment, mem_len))
    return segs


def compare_stream(runtime, reference_model, batch: int = 2, seed: int = 0, segments=None) -> dict:
    """Feed the same random stream to `runtime` (a TxlRuntime) and `reference_model` (MemTransformerLM)."""
    import torch

    cfg = runtime.config
    segments = segments or verification_segments(runtime.mem_len, runtime.backend.max_segment)
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.n_token, size=(batch, sum(segments)), dtype=np.int64)
    runtime.reset()
    mems, pos, worst, agree, total = None, 0, 0.0, 0, 0
    with torch.no_grad():
        for q in segments:
            seg = tokens[:, pos:pos + q]
            ref, mems = reference_model(torch.from_numpy(seg), mems)
            ref = ref.numpy()
            got = runtime.step(seg)
            worst = max(worst, float(np.abs(got.astype(np.float64) - ref).max()))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            total += got.shape[0] * got.shape[1]
            pos += q
    runtime.reset()
    return {"max_abs_diff": worst, "top1_agreement": agree / total, "tokens": total, "batch": batch,
            "segments": list(segments)}


def verify_export(onnx_path, reference_model, tolerance: float | None = None, providers=None, log=print) -> dict:
    """Run the exported file in ONNX Runtime against the reference; returns the report (passed or not)."""
    from txl_deploy.runtimes import TxlRuntime

    with TxlRuntime.load(onnx_path, providers=providers) as rt:
        precision = rt.backend.precision
        tol = DEFAULT_TOLERANCE.get(precision, 1e-4) if tolerance is None else tolerance
        report = compare_stream(rt, reference_model)
    report.update(tolerance=tol, precision=precision, passed=report["max_abs_diff"] <= tol)
    log(f"  max abs difference {report['max_abs_diff']:.3g} (tolerance {tol:g}), top-1 agreement "
        f"{report['top1_agreement']:.4f} over {report['tokens']} positions in segments {report['segments']}"
        f" -> {'OK' if report['passed'] else 'MISMATCH'}")
    return report
