"""A reduced graph against its fp32 graph: the stream comparison and the held-out evaluation behind the report."""

from __future__ import annotations

import numpy as np

from txl_deploy.exporters.onnx.verify import compare_steps, verification_segments
from txl_deploy.progress import progress_bar
from txl_deploy.runtimes.evaluation import streaming_eval


def compare_to_fp32(rt, rt32, batch: int = 2, seed: int = 0) -> dict:
    """Both graphs on the same random multi-segment stream (partly empty memory, decode, prefill, ring wrap)."""
    segments = verification_segments(rt.mem_len, rt.backend.max_segment)
    rt.reset(), rt32.reset()
    try:
        report = compare_steps(rt.step, rt32.step, rt.n_token, segments, batch, seed)
    finally:
        rt.reset(), rt32.reset()
    report.pop("tolerance_used")  # fp32's own rule: a reduced graph is judged by the KL divergence
    return {**report, "reference": "fp32 graph (ONNX Runtime CPU)"}


def evaluate_against_fp32(rt, rt32, ids: np.ndarray, seg: int, progress=True) -> dict:
    """Streaming evaluation of `ids` by both graphs: bits per character / perplexity and top-1 agreement."""
    argmax = {}

    def stepper(runtime, key):
        def step(tokens):
            lp = runtime.step(tokens)
            argmax.setdefault(key, []).append(lp[0].argmax(-1))
            return lp
        return step

    results = {}
    for key, runtime in (("fp32", rt32), ("reduced", rt)):
        runtime.reset()
        with progress_bar(total=ids.size - 1, desc=f"evaluating {key if key == 'fp32' else rt.backend.precision}",
                          unit="tok", enabled=progress) as bar:
            results[key] = streaming_eval(ids, stepper(runtime, key), seg, progress=bar.update)
        runtime.reset()
    agree = float(np.mean(np.concatenate(argmax["reduced"]) == np.concatenate(argmax["fp32"])))
    return {"fp32": results["fp32"], "reduced": results["reduced"], "top1_agreement": agree}


def accuracy_report(evaluation: dict, kind: str) -> dict:
    """The headline numbers: bits per character for character vocabularies (bits per byte for enwik8's bytes),
    perplexity for words and music events."""
    metric = {"word": "perplexity", "events": "perplexity", "bytes": "bits_per_byte"}.get(kind, "bits_per_character")
    key = "perplexity" if metric == "perplexity" else "bits_per_token"
    base, new = evaluation["fp32"][key], evaluation["reduced"][key]
    return {"metric": metric, "fp32": base, "reduced": new, "relative_change": (new - base) / base,
            "top1_agreement": evaluation["top1_agreement"], "tokens": evaluation["fp32"]["n_tokens"]}
