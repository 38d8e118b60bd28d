"""The bundled demo model through the deployment path: ONNX Runtime reproduces the recorded bits per character,
`txl-deploy eval` reproduces the README's number, and `txl-deploy demo` (the README's main job) runs end to end."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from txl_deploy.assets import demo_heldout_path, demo_model_path, demo_training_record
from txl_deploy.cli import main


def test_onnxruntime_reproduces_the_recorded_slice_bpc(demo_onnx):
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.evaluation import evaluate_text

    record = demo_training_record()
    text = demo_heldout_path().read_text(encoding="utf-8")[: record["heldout_slice"]["characters"]]
    with TxlRuntime.load(demo_onnx) as rt:
        result = evaluate_text(rt, text, rt.config.tgt_len, progress=False)
    assert result["unit"] == "bpc"
    assert result["bits_per_token"] == pytest.approx(record["heldout_slice"]["bpc"], abs=0.01)


def test_eval_command_reproduces_the_heldout_bpc_in_the_readme(demo_onnx, tmp_path):
    """The README quotes training.json's held-out bpc; `txl-deploy eval` on the whole held-out text gives it."""
    record = demo_training_record()
    out = tmp_path / "eval.json"
    r = CliRunner().invoke(main, ["eval", str(demo_onnx), "--text", str(demo_heldout_path()), "--json", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert result["n_tokens"] == record["heldout"]["characters"] - 1
    assert result["bits_per_token"] == pytest.approx(record["heldout"]["bpc"], abs=0.01)
    assert "bits per character" in r.output
    readme = (demo_model_path().parents[3] / "README.md")
    if readme.is_file():  # a source checkout: the number in the README is the recorded one
        assert f"{record['heldout']['bpc']:.3f}" in readme.read_text()


def test_demo_command_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["demo", "--out", str(out), "--max-new-tokens", "40", "--eval-chars", "3000",
                                  "--parity-chars", "500"])
    assert r.exit_code == 0, r.output
    for name in ("model.onnx", "sample.txt", "bench.json", "summary.json"):
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    verification = summary["verification"]
    assert verification["passed"] and verification["kl_divergence"] >= 0
    assert "allclose_ratio" not in verification and 0 <= verification["tolerance_used"] <= 1
    parity = summary["eval"]["parity"]
    assert parity["onnxruntime"] == pytest.approx(parity["torch"], abs=1e-3)
    # the summary's speedup is the benchmark's own ratio of medians, and both sides computed the same log-probs
    bench = json.loads((out / "bench.json").read_text())["results"][0]
    c, b = bench["sides"]["candidate"]["decode_ms"], bench["sides"]["baseline"]["decode_ms"]
    assert c["n"] == b["n"] == 32 * 3
    assert summary["bench"][0]["speedup"]["decode_p50"] == pytest.approx(b["p50"] / c["p50"])
    assert bench["parity"]["max_abs_diff"] <= 1e-4 and bench["parity"]["top1_agreement"] == 1.0
    assert (out / "sample.txt").read_text().startswith("And God said")
    # a second run into the same folder needs --force: nothing is overwritten silently
    r = CliRunner().invoke(main, ["demo", "--out", str(out), "--no-bench"])
    assert r.exit_code == 2 and "already exists" in r.output
