"""The aarch64 CI step's judge (tests/arm64/check.py) rejects what it must: log-probs outside the fp32 export
tolerance, a different greedy continuation, a different `txl-deploy eval` score, or a guest that was not aarch64.
The step itself runs under QEMU from .ci/run (tests/arm64/run.sh); this checks its verdicts on made-up outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location("arm64_check", Path(__file__).with_name("check.py"))
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)

SEGMENTS, N_TOKEN = [3, 1, 6, 1], 9


@pytest.fixture
def work(tmp_path):
    tokens = check.stream_tokens(N_TOKEN, SEGMENTS)
    logits = np.random.default_rng(1).normal(size=(*tokens.shape, N_TOKEN))
    log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    greedy = np.array([4, 1, 7, 7, 2])
    np.savez(tmp_path / "reference.npz", tokens=tokens, log_probs=log_probs, segments=np.array(SEGMENTS),
             greedy=greedy)
    np.savez(tmp_path / "guest-cortex-a72.npz", tokens=tokens, log_probs=log_probs.copy(), greedy=greedy.copy())
    meta = {"machine": "aarch64", "txl_deploy": str(tmp_path / "own" / "txl_deploy" / "__init__.py"),
            "sample": "And God said"}
    (tmp_path / "guest-cortex-a72.json").write_text(json.dumps(meta))
    result = {"n_tokens": 511, "loss": 1.0692, "bits_per_token": 1.542550, "seconds": 1.0}
    (tmp_path / "eval-x86_64.json").write_text(json.dumps(result))
    (tmp_path / "eval-cortex-a72.json").write_text(json.dumps(result))
    return tmp_path


def verdict(work):
    ref = np.load(work / "reference.npz")
    return check.judge_guest(work, "cortex-a72", ref, json.loads((work / "eval-x86_64.json").read_text()))


def rewrite(work, **changes):
    got = dict(np.load(work / "guest-cortex-a72.npz"))
    got.update(changes)
    np.savez(work / "guest-cortex-a72.npz", **got)


def test_identical_outputs_pass(work):
    ok, lines = verdict(work)
    assert ok, lines
    assert "-> OK" in lines[0] and "identical" in lines[1] and lines[2].endswith(" s") and ": OK" in lines[2]


def test_log_probs_outside_the_fp32_tolerance_fail(work):
    log_probs = np.load(work / "guest-cortex-a72.npz")["log_probs"]
    log_probs[1, 5, 3] += 3e-4  # atol 1e-4 + rtol 1e-5 x |log-prob| is < 2e-4 for these log-probs
    rewrite(work, log_probs=log_probs)
    ok, lines = verdict(work)
    assert not ok and "MISMATCH" in lines[0]


def test_log_probs_inside_the_tolerance_pass(work):
    log_probs = np.load(work / "guest-cortex-a72.npz")["log_probs"]
    log_probs[0, 2, 1] += 5e-5
    rewrite(work, log_probs=log_probs)
    assert verdict(work)[0]


def test_a_different_greedy_token_fails(work):
    rewrite(work, greedy=np.array([4, 1, 7, 3, 2]))
    ok, lines = verdict(work)
    assert not ok and "differ from token 3" in lines[1]


def test_a_different_eval_score_fails(work):
    result = json.loads((work / "eval-cortex-a72.json").read_text())
    result["bits_per_token"] += 1e-3
    (work / "eval-cortex-a72.json").write_text(json.dumps(result))
    ok, lines = verdict(work)
    assert not ok and "MISMATCH" in lines[2]


def test_a_guest_that_is_not_aarch64_fails(work):
    meta = json.loads((work / "guest-cortex-a72.json").read_text())
    meta["machine"] = "x86_64"
    (work / "guest-cortex-a72.json").write_text(json.dumps(meta))
    ok, lines = verdict(work)
    assert not ok and "did not run our wheel on aarch64" in lines[0]
