"""`benchmarks/paper_table9.py`: both sides read the same tokens, and the benchmark runs end to end at tiny size,
writing its results file (naming its command), its JSON and its plot. Nothing is timed here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import paper_table9
from benchmarks.harness import generating_command
from benchmarks.paper_table9 import inputs
from txl_deploy.errors import InputError

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "paper_table9.py"


def test_both_sides_predict_the_same_positions_from_the_same_stream():
    """Vanilla window r holds the L tokens ending at stream position L + r: the token whose next-token distribution
    Transformer-XL gives at position r of its segment, with the L tokens before the segment in its memory."""
    stream = np.arange(100)
    io = inputs(stream, length=30, segment=8, windows=4)
    assert io.fill.tolist() == [list(range(30))]
    assert io.segment.tolist() == [list(range(30, 38))]
    for r, window in enumerate(io.windows):
        assert window.shape == (1, 30)
        assert window[0, -1] == io.segment[0, r]
        assert window.tolist() == [list(range(r + 1, r + 31))]
    with pytest.raises(InputError):
        inputs(stream, length=95, segment=8, windows=4)  # the stream is too short
    with pytest.raises(InputError):
        inputs(stream, length=30, segment=3, windows=4)  # more windows than segment positions


def test_end_to_end_at_tiny_size(tiny_ckpt, tmp_path):
    md = tmp_path / "results_table9.md"
    args = ["--model", str(tiny_ckpt), "--lengths", "12", "--segment", "4", "--rounds", "2", "--decode-steps", "2",
            "--cache-dir", str(tmp_path / "cache"), "--md", str(md)]
    assert paper_table9.main(args) == 0
    text = md.read_text()
    assert generating_command(text) == "python -m benchmarks.paper_table9 " + " ".join(args)
    assert "| attention length L |" in text and "| 12 |" in text and "What each side computes" in text
    result = json.loads(md.with_suffix(".json").read_text())
    (row,) = result["rows"]
    assert row["length"] == 12 and row["paper_slowdown"] is None
    rounds = row["rounds_s"]
    assert len(rounds["vanilla_window"]) == len(rounds["txl_evaluation_per_token"]) == 2  # warm-up dropped
    assert all(len(r) == 2 for r in rounds["txl_one_token_per_call"])
    assert row["vanilla_ms_per_token"] == pytest.approx(1e3 * np.median(rounds["vanilla_window"]))
    assert row["slowdown_evaluation"] == pytest.approx(row["vanilla_ms_per_token"] / row["txl_evaluation_ms_per_token"])
    assert row["slowdown_one_token_per_call"] == pytest.approx(
        row["vanilla_ms_per_token"] / row["txl_one_token_per_call_ms"])
    assert result["vanilla_check"]["max_abs_diff"] <= 1e-4  # the vanilla export against PyTorch
    assert result["settings"]["threads"] == 1 and result["config"]["n_layer"] == 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert md.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "(results_table9.png)" in text
    before = text
    assert paper_table9.main(args) == 2  # nothing is overwritten without --force, and nothing measured first
    assert md.read_text() == before

