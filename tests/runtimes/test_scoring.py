"""Scoring many texts (`TxlRuntime.score_texts`): each item's log-prob equals `TxlRuntime.score` of start + context
+ text alone; hypotheses forked from one reading of their context equal each read after its own copy of the
context; batches cut by the memory budget change nothing; a bad item gets its own error and the others are scored.

Tolerance: the same backend computes both sides; a batch row may take other kernels than a lone row (observed
~1e-6 per token), so per-token log-probs match to 1e-5 and sums over ~30 tokens to 1e-4.
"""

from __future__ import annotations

import numpy as np
import pytest

from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.score_input import ScoreItem

TOL = 1e-5
EOS = 58  # helpers.tiny.TINY_VOCAB's <eos>


def words(rng, n):
    return " ".join(f"w{i}" for i in rng.integers(0, 58, n))


def alone(rt, item: ScoreItem, start=True):
    """Per-token log-probs of the text scored by TxlRuntime.score on start + context + text, one row."""
    prefix = ([EOS] if start else []) + (rt.encode(item.context).tolist() if item.context else [])
    ids = np.array(prefix + rt.encode(item.text).tolist())
    rt.reset()
    nll = rt.score(ids[None])[0]
    rt.reset()
    return -nll[max(len(prefix), 1) - 1:]


@pytest.fixture(scope="module")
def items():
    rng = np.random.default_rng(7)
    ctx_a, ctx_b = words(rng, 30), words(rng, 5)
    out = [ScoreItem(words(rng, int(rng.integers(1, 12))), ctx_a, "a") for _ in range(5)]
    out += [ScoreItem(words(rng, int(rng.integers(1, 9))), ctx_b) for _ in range(3)]
    out += [ScoreItem(words(rng, int(rng.integers(1, 20)))) for _ in range(4)]
    order = rng.permutation(len(out))  # groups interleaved in the input
    return [out[i] for i in order]


def test_score_leaves_the_memory_as_if_fed_once(ort_rt):
    tokens = np.random.default_rng(3).integers(0, 60, (2, 21))  # 20 scored: a last chunk of 4 after 16
    ort_rt.reset()
    ort_rt.score(tokens[:, :20])
    got = ort_rt.step(tokens[:, 20:])
    ort_rt.reset()
    expect = ort_rt.step(tokens)[:, 20:]
    ort_rt.reset()
    np.testing.assert_allclose(got, expect, atol=TOL)


def test_each_item_equals_its_text_scored_alone(ort_rt, items):
    results = ort_rt.score_texts(items, per_token=True)
    assert ort_rt.batch_size is None  # the memory is left empty
    for item, got in zip(items, results):
        want = alone(ort_rt, item)
        assert got["n_tokens"] == want.size == len(item.text.split())
        np.testing.assert_allclose(got["token_log_probs"], want, atol=TOL)
        assert got["log_prob"] == pytest.approx(float(want.sum()), abs=1e-4)
        assert got["perplexity"] == pytest.approx(np.exp(-got["log_prob"] / got["n_tokens"]))
        assert got["tokens"] == item.text.split() and got["token_ids"] == ort_rt.encode(item.text).tolist()


def test_a_forked_context_equals_rereading_it_per_hypothesis(ort_rt, items):
    forked = ort_rt.score_texts(items)
    spy, select_rows = [], ort_rt.select_rows
    ort_rt.select_rows = lambda rows: (spy.append(len(rows)), select_rows(rows))[1]
    try:
        reread = ort_rt.score_texts([ScoreItem(it.text, it.context, group=n) for n, it in enumerate(items)])
        assert spy == [1] * len(items)  # every hypothesis read its own context
        spy.clear()
        ort_rt.score_texts(items)
        assert sorted(spy) == [3, 4, 5]  # three contexts (one empty: the start alone), each read once
    finally:
        del ort_rt.select_rows
    for f, r in zip(forked, reread):
        assert f["n_tokens"] == r["n_tokens"]
        assert f["log_prob"] == pytest.approx(r["log_prob"], abs=1e-4)


def test_a_tiny_budget_cuts_batches_and_changes_nothing(ort_rt, items):
    whole = ort_rt.score_texts(items, per_token=True)
    fed = []
    step = ort_rt.step
    ort_rt.step = lambda tokens, *a, **k: (fed.append(np.shape(tokens)[0]), step(tokens, *a, **k))[1]
    try:
        cut = ort_rt.score_texts(items, per_token=True, batch_budget=1)
    finally:
        del ort_rt.step
    assert set(fed) == {1}  # one row per batch
    for w, c in zip(whole, cut):
        np.testing.assert_allclose(c["token_log_probs"], w["token_log_probs"], atol=TOL)


def test_without_same_length_the_shared_reading_keeps_the_segments_of_the_text_alone(tiny_ckpt):
    # without same_length a prediction depends on where segments start once the text outgrows the memory (12
    # tokens): 4-token segments; start + context + text of 9 to 20 tokens (a context of 7 is read whole at 12)
    with TxlRuntime.load(tiny_ckpt, backend="torch-fast", same_length=False, max_segment=4, threads=1) as rt:
        assert not rt.config.same_length and rt.mem_len == 12
        rng = np.random.default_rng(11)
        ctx = words(rng, 10)
        items = [ScoreItem(words(rng, n), ctx) for n in (1, 6, 9)] + [ScoreItem(words(rng, 5), "w1 w2 w3")]
        items += [ScoreItem(words(rng, 5), words(rng, 6), group="fits")]
        for item, got in zip(items, rt.score_texts(items, per_token=True)):
            np.testing.assert_allclose(got["token_log_probs"], alone(rt, item), atol=TOL)


def test_what_is_counted_without_a_start_and_with_the_line_end(ort_rt):
    text = "w1 w2 w3"
    bare, = ort_rt.score_texts([text], per_token=True, start=False)
    assert bare["n_tokens"] == 2 and bare["token_log_probs"][0] is None
    np.testing.assert_allclose(bare["token_log_probs"][1:], alone(ort_rt, ScoreItem(text), start=False), atol=TOL)
    closed, = ort_rt.score_texts([text], per_token=True, line_end=True)
    assert closed["n_tokens"] == 4 and closed["tokens"] == ["w1", "w2", "w3", "<eos>"]
    np.testing.assert_allclose(closed["token_log_probs"], alone(ort_rt, ScoreItem(text + "\n")), atol=TOL)


def test_a_bad_item_gets_its_own_error_and_the_others_are_scored(ort_rt, demo_onnx):
    good = ScoreItem("w1 w2", "w3 w4", "g")
    results = ort_rt.score_texts([good, "", "   ", ScoreItem("w5", "w9", "g"), {"txt": "w1"}, 12,
                                  {"text": "w1", "group": [1]}, good])
    errors = [r.get("error") for r in results]
    assert errors[0] is None and errors[-1] is None and results[0] == results[-1]
    assert errors[1] == "empty text" and "no tokens" in errors[2]
    assert "another context" in errors[3] and "unknown field 'txt'" in errors[4]
    assert "str, a ScoreItem or a dict" in errors[5] and "group must be" in errors[6]
    assert ort_rt.score_texts(["w1"], start=False)[0]["error"].startswith("nothing to score")
    with TxlRuntime.load(demo_onnx, threads=1) as demo:
        assert demo.vocab.unk is None
        out = demo.score_texts(["In the beginning", "price: 5\u20ac", "and the earth"])
        assert "not in the vocabulary" in out[1]["error"] and "\u20ac" in out[1]["error"]
        assert out[0]["n_tokens"] == len("In the beginning") - 1  # a character model has no start symbol
        assert out[2]["n_tokens"] == len("and the earth") - 1
