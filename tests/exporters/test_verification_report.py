"""What the verification report says: a KL divergence is never negative, and each field measures what its name
says (`tolerance_used` is the share of fp32's tolerance the worst log-prob uses)."""

from __future__ import annotations

import numpy as np

from txl_deploy.exporters.onnx.verify import FP32_ATOL, FP32_RTOL, compare_steps, judge, kl_divergence


def _log_softmax32(logits):
    x = logits.astype(np.float64)
    return (x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)
            ).astype(np.float32)


def test_kl_of_two_float32_roundings_of_one_distribution_is_not_negative():
    rng = np.random.default_rng(0)
    ref = _log_softmax32(rng.normal(size=(64, 300)) * 3)
    # the same distribution, off by float32 rounding: the plain sum of p * (log p - log q) goes negative
    got = (ref.astype(np.float64) + rng.normal(size=ref.shape) * 2e-7 + 3e-7).astype(np.float32)
    plain = float(np.sum(np.exp(ref.astype(np.float64)) * (ref - got).astype(np.float64)))
    assert plain < 0
    kl = kl_divergence(ref, got)
    assert 0 <= kl < 1e-9


def test_kl_matches_the_float64_definition_where_it_is_large():
    rng = np.random.default_rng(1)
    ref, got = _log_softmax32(rng.normal(size=(8, 50))), _log_softmax32(rng.normal(size=(8, 50)))
    p64 = np.exp(ref.astype(np.float64))
    want = float(np.sum(p64 * (ref.astype(np.float64) - got.astype(np.float64))))
    assert abs(kl_divergence(ref, got) - want) < 1e-5 * want


def test_the_report_says_how_much_of_the_tolerance_the_worst_log_prob_uses():
    rng = np.random.default_rng(2)
    table = _log_softmax32(rng.normal(size=(2, 4, 20)))
    shift = np.float32(FP32_ATOL / 2)

    def step(q):
        return lambda tokens: table[:, :tokens.shape[1]] + (shift if q else 0)

    report = judge(compare_steps(step(True), step(False), 20, [4, 3], batch=2), "fp32")
    worst = float(np.max(np.float32(FP32_ATOL / 2) / (FP32_ATOL + FP32_RTOL * np.abs(table))))
    assert "allclose_ratio" not in report and report["passed"]
    assert abs(report["tolerance_used"] - worst) < 0.01 * worst  # float32 sums round the shift and report["tolerance_used"] < 1
    assert report["kl_divergence"] >= 0
    reduced = judge(compare_steps(step(True), step(False), 20, [4, 3], batch=2), "int8")
    assert "tolerance_used" not in reduced  # fp32's rule does not judge a reduced graph
