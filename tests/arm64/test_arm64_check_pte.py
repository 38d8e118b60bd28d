"""The aarch64 ExecuTorch check's judge (tests/arm64/check_pte.py, run by `tests/arm64/run.sh --executorch`) rejects
what it must: log-probs outside the fp32 export tolerance, a different greedy continuation, a guest that was not
aarch64, or a guest ExecuTorch without XNNPACK (the program's delegate). The check itself runs under QEMU by hand;
this checks its verdicts on made-up outputs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

spec = importlib.util.spec_from_file_location("arm64_check_pte", Path(__file__).with_name("check_pte.py"))
check_pte = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_pte)

SEGMENTS, N_TOKEN, CPU = [3, 1, 6, 1], 9, "cortex-a76"


@pytest.fixture
def work(tmp_path):
    tokens = check_pte.check.stream_tokens(N_TOKEN, SEGMENTS)
    logits = np.random.default_rng(1).normal(size=(*tokens.shape, N_TOKEN))
    log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    greedy = np.array([4, 1, 7, 7, 2])
    np.savez(tmp_path / "reference.npz", tokens=tokens, log_probs=log_probs, segments=np.array(SEGMENTS),
             greedy=greedy)
    np.savez(tmp_path / f"guest-pte-{CPU}.npz", tokens=tokens, log_probs=log_probs.copy(), greedy=greedy.copy())
    write_meta(tmp_path, machine="aarch64", txl_deploy=str(tmp_path / "own" / "txl_deploy" / "__init__.py"),
               sample="And God said", backends=["XnnpackBackend"])
    return tmp_path


def write_meta(work, **meta):
    (work / f"guest-pte-{CPU}.json").write_text(json.dumps(meta))


def edit_meta(work, **changes):
    meta = json.loads((work / f"guest-pte-{CPU}.json").read_text())
    write_meta(work, **{**meta, **changes})


def rewrite(work, **changes):
    got = dict(np.load(work / f"guest-pte-{CPU}.npz"))
    got.update(changes)
    np.savez(work / f"guest-pte-{CPU}.npz", **got)


def verdict(work):
    return check_pte.judge_guest(work, CPU, np.load(work / "reference.npz"))


def test_identical_outputs_pass(work):
    ok, lines = verdict(work)
    assert ok, lines
    assert "-> OK" in lines[0] and "identical" in lines[1]


def test_log_probs_outside_the_fp32_tolerance_fail(work):
    log_probs = np.load(work / f"guest-pte-{CPU}.npz")["log_probs"]
    log_probs[0, 7, 2] -= 3e-4  # atol 1e-4 + rtol 1e-5 x |log-prob| is < 2e-4 for these log-probs
    rewrite(work, log_probs=log_probs)
    ok, lines = verdict(work)
    assert not ok and "MISMATCH" in lines[0]


def test_log_probs_inside_the_tolerance_pass(work):
    log_probs = np.load(work / f"guest-pte-{CPU}.npz")["log_probs"]
    log_probs[1, 3, 0] += 5e-5
    rewrite(work, log_probs=log_probs)
    assert verdict(work)[0]


def test_a_different_greedy_token_fails(work):
    rewrite(work, greedy=np.array([4, 1, 7, 7, 5]))
    ok, lines = verdict(work)
    assert not ok and "differ from token 4" in lines[1]


def test_a_guest_that_is_not_aarch64_fails(work):
    edit_meta(work, machine="x86_64")
    ok, lines = verdict(work)
    assert not ok and "did not run our wheel on aarch64" in lines[0]


def test_a_guest_without_xnnpack_fails(work):
    edit_meta(work, backends=[])
    ok, lines = verdict(work)
    assert not ok and "no XNNPACK backend" in lines[-1]
