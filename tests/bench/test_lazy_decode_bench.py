"""The lazy-vs-full generation benchmark's logic on the tiny model (adaptive softmax, two tail clusters): the
runtime's lazy switch, the two timed sides giving the same tokens, the rates counted, the head fitted to target
rates, the report (no timing is asserted)."""

import argparse
from pathlib import Path

import numpy as np
import pytest

from benchmarks import harness
from benchmarks import lazy_decode as ld
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.sampling import Clusters

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rt(tiny_onnx):
    with TxlRuntime.load(tiny_onnx, threads=1) as rt:
        assert rt.backend.clusters is not None, "the tiny export has its head and tail graphs"
        yield rt


def test_lazy_off_generates_the_same_tokens_through_the_full_distribution(rt):
    rt.reset()
    lazy = list(rt.generate([3, 4, 5], max_new_tokens=20, seed=5))
    counted = dict(rt.tail_stats, tails=list(rt.tail_stats["tails"]))
    assert counted["decisions"] >= 20
    rt.reset()
    rt.lazy = False
    try:
        assert list(rt.generate([3, 4, 5], max_new_tokens=20, seed=5)) == lazy
        assert rt.tail_stats["decisions"] == counted["decisions"]  # the full path computes every tail: none counted
    finally:
        rt.lazy = True


def test_load_takes_the_switch(tiny_onnx):
    with TxlRuntime.load(tiny_onnx, lazy=False) as rt:
        assert rt.lazy is False and rt.backend.clusters is not None


def test_the_timed_sides_agree_and_count_the_tails_they_run(rt):
    rt.reset()
    rt.prefill(np.arange(rt.mem_len).reshape(1, -1) % rt.n_token)
    state = rt.save_state()
    sides = {side: (lambda r, lazy=(side == "lazy"): ld.time_generate(rt, state, 7, 12, 3 + r, {"temperature": 1.0},
                                                                       lazy)) for side in ("lazy", "full")}
    out = harness.interleaved(sides, rounds=3)
    for a, b in zip(out["lazy"], out["full"]):
        assert a["tokens"] == b["tokens"] and len(a["tokens"]) == 12
        assert b["tails"] == [0, 0] and all(0 <= t <= 12 for t in a["tails"])
    s = ld.summarize(out["lazy"], out["full"], 12, 1)
    assert s["tokens_identical"] and s["rounds"] == 3 and s["tokens_per_round"] == 12
    want = np.sum([x["tails"] for x in out["lazy"]], axis=0) / 36
    assert s["tail_fractions"] == pytest.approx(want.tolist())
    ratios = [f["seconds"] / z["seconds"] for z, f in zip(out["lazy"], out["full"])]
    assert s["speedup"] == pytest.approx(float(np.median(ratios)))


def test_batched_sides_agree_row_by_row(rt):
    rt.reset()
    rt.prefill(np.arange(4 * rt.mem_len).reshape(4, -1) % rt.n_token)
    arrays = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
    sampled = {}
    for name, controls in {"greedy": {"temperature": 0.0}, "T=1": {"temperature": 1.0},
                           "top-k 5": {"temperature": 1.0, "top_k": 5}}.items():
        lazy = ld.time_batched(rt.backend, arrays, np.array([1, 2, 3, 4]), 10, 11, controls, lazy=True)
        full = ld.time_batched(rt.backend, arrays, np.array([1, 2, 3, 4]), 10, 11, controls, lazy=False)
        assert lazy["tokens"].shape == (4, 10) and np.array_equal(lazy["tokens"], full["tokens"]), name
        assert full["tail_rows"] == [0, 0] and all(0 <= t <= 40 for t in lazy["tail_rows"])
        sampled[name] = lazy["tokens"]
    assert len({tuple(row) for row in sampled["T=1"]}) > 1  # each row its own seed
    # every call starts from the saved memory, which a call does not advance
    again = ld.time_batched(rt.backend, arrays, np.array([1, 2, 3, 4]), 10, 11, {"temperature": 1.0}, lazy=True)
    assert np.array_equal(again["tokens"], sampled["T=1"])


def test_the_head_fit_reaches_greedy_and_sampled_rates():
    """On random hidden states and weights shaped like a small adaptive softmax, the fitted (scale, bias) give the
    targets: greedy exactly up to the sample's granularity, T=1 within a percent."""
    rng = np.random.default_rng(0)
    hidden = rng.normal(size=(400, 32))
    fit = ld.HeadFit(hidden, rng.normal(size=(200, 32)) * 0.02, np.zeros(200), hidden @ rng.normal(size=(32, 3)) * 0.02)
    greedy, sampled = [0.45, 0.35, 0.35], [0.08, 0.06, 0.03]
    got = ld.calibrate_head(fit, greedy, sampled)
    assert got["greedy"] == pytest.approx(greedy, abs=2 / 400)
    assert got["sampled"] == pytest.approx(sampled, abs=0.01)
    assert fit.rates(got["scale"], got["bias"])[1] == pytest.approx(got["sampled"])


def test_report_lists_rates_speedups_and_the_token_check():
    args = argparse.Namespace(rounds=2, tokens=4, batch_tokens=2, trained_tokens=16, seed=7)
    trained = {m: {"fractions": [0.5, 0.25, 0.125]} for m in ld.MODES}
    fit = {"greedy": [0.5, 0.25, 0.125], "sampled": [0.1, 0.05, 0.01]}

    def side(seconds, tails, batch, n):
        key = "tails" if batch == 1 else "tail_rows"
        return [{"seconds": s, "tokens": np.full((batch, n), i), key: tails} for i, s in enumerate(seconds)]

    results = {m: {"1": ld.summarize(side([1.0, 2.0], [2, 1, 0], 1, 4), side([3.0, 2.0], [0, 0, 0], 1, 4), 4, 1),
                   "8": ld.summarize(side([1.0, 1.0], [8, 0, 0], 8, 2), side([1.5, 1.5], [0, 0, 0], 8, 2), 2, 8)}
               for m in ld.MODES}
    off = side([1.0, 1.0], [8, 0, 0], 8, 2)
    off[1]["tokens"] = off[1]["tokens"].copy()
    off[1]["tokens"][3, 1] = 2  # row 3 of round 1 draws the next id at its second step
    results["T=1"]["8"] = ld.summarize(off, side([1.5, 1.5], [0, 0, 0], 8, 2), 2, 8)
    parts = {"head_ms": 40.0, "tail_ms": [10.0, 50.0, 20.0], "full_ms": 110.0}
    for m in ld.MODES:
        results[m]["1"]["at_trained_rates"] = ld.at_rates(results[m]["1"], parts, trained[m]["fractions"])
        results[m]["1"]["byte_bound"] = {"full_mb": 636.0, "lazy_mb": 375.0, "tail_mb": [33.0, 263.0, 111.0],
                                         "bound": 636.0 / 375.0}
    clusters = Clusters(20000, [(20000, 40000), (40000, 200000), (200000, 267735)])
    text = ld.report(args, "python -m benchmarks.lazy_decode --rounds 2", trained, fit, results, parts, 1.0, 2.0,
                     clusters)
    assert text.startswith("# Lazy adaptive-softmax generation against full")
    assert "Generated by `python -m benchmarks.lazy_decode --rounds 2`" in text
    assert "| greedy | 50.0% / 25.0% / 12.5% | 50.0% / 25.0% / 0.0% | 50.0% / 0.0% / 0.0% |" in text
    # batch 1: rounds of 3 s / 1 s and 2 s / 2 s -> median ratio 2.00x, range 1.00 to 3.00, the target met
    assert "| T=1 | 1 | 3.00 | 1.67 | 2.00x (1.00 to 3.00) | yes | yes |" in text
    assert "| top-k 40 | 8 | 16.00 | 10.67 | 1.50x (1.50 to 1.50) | yes |  |" in text
    assert "| T=1 | 8 | 16.00 | 10.67 | 1.50x (1.50 to 1.50) | NO |  |" in text
    assert ("Streams that differ (1, in modes and batches that made 32 decisions in all), at their first differing "
            "token: T=1, batch 8, round 1 row 3 step 1: lazy 2, full 1. Adjacent ids") in text
    assert "at most full / head = 2.75x" in text
    # at the trained rates (50% / 25% / 12.5% against the stand-in's 50% / 25% / 0%): + 0.125 x 20 ms a token,
    # rounds of 0.25 + 0.0025 s and 0.5 + 0.0025 s a token against 0.75 s and 0.5 s
    est = results["greedy"]["1"]["at_trained_rates"]
    assert est["speedup"] == pytest.approx(float(np.median([0.75 / 0.2525, 0.5 / 0.5025])))
    assert "head graph 40.0 ms, tail 1 / 2 / 3 10.0 / 50.0 / 20.0 ms, main graph 110.0 ms" in text
    assert f"| greedy | {est['lazy_tokens_per_s']:.2f} | 1.67 | {est['speedup']:.2f}x | NO | 375 | 1.70x |" in text
    assert "a full step reads 636 MB, tails 1 / 2 / 3 33.0 / 263.0 / 111.0 MB of it" in text


def test_the_byte_bound_counts_the_tails_a_lazy_token_reads(rt):
    path = rt.backend.path
    full = ld.byte_bound(path, [1.0, 1.0])  # every tail every token: a full step's bytes
    assert full["lazy_mb"] == pytest.approx(full["full_mb"]) and full["bound"] == pytest.approx(1.0)
    # The tiny model's tails (div_val 2, d_model 32): tail 1 is 20 words of d_emb 16, tail 2 30 words of d_emb 8,
    # each with its bias and its projection [32, d_emb]; fp32.
    none = ld.byte_bound(path, [0.0, 0.0])
    assert [round(t * 1e6) for t in none["tail_mb"]] == [4 * (20 * 16 + 20 + 32 * 16), 4 * (30 * 8 + 30 + 32 * 8)]
    assert none["lazy_mb"] == pytest.approx(full["full_mb"] - sum(none["tail_mb"]))
    half = ld.byte_bound(path, [0.5, 0.0])
    assert half["lazy_mb"] == pytest.approx(none["lazy_mb"] + 0.5 * none["tail_mb"][0])
    assert half["bound"] == pytest.approx(half["full_mb"] / half["lazy_mb"])


def test_parts_are_timed_on_the_saved_state(rt):
    rt.reset()
    rt.prefill(np.arange(rt.mem_len).reshape(1, -1) % rt.n_token)
    arrays = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
    parts = ld.time_parts(rt.backend, arrays, 5, reps=2)
    assert len(parts["tail_ms"]) == 2 and parts["head_ms"] > 0 and parts["full_ms"] > 0


def test_summary_says_where_streams_differ():
    lazy = [{"seconds": 1.0, "tokens": np.array([[1, 2, 3], [4, 5, 6]]), "tail_rows": [1, 0]}]
    full = [{"seconds": 2.0, "tokens": np.array([[1, 2, 3], [4, 7, 8]]), "tail_rows": [0, 0]}]
    s = ld.summarize(lazy, full, 3, 2)
    assert not s["tokens_identical"]
    assert s["differ"] == [{"round": 0, "row": 1, "step": 1, "lazy": 5, "full": 7}]
    assert s["tail_fractions"] == pytest.approx([1 / 6, 0.0]) and s["speedup"] == 2.0
