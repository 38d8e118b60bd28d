"""benchmarks/scoring.py end to end at tiny size (`--quick`): every side scores the same text as ONNX Runtime does
(within 1e-4 nats), the forked hypotheses score as their re-read ones, beam search finds HuggingFace's best
hypothesis, and the results files hold every batch and side. The compute floor counts the memory's keys from the
second segment on. Nothing is timed."""

from __future__ import annotations

import json

from benchmarks import scoring
from txl_deploy.checkpoints import load_model


def test_scoring_benchmark_quick_run(tiny_ckpt, tmp_path):
    md = tmp_path / "results_scoring.md"
    args = ["--quick", "--model", str(tiny_ckpt), "--cache-dir", str(tmp_path / "cache"), "--md", str(md)]
    assert scoring.main(args) == 0
    raw = json.loads(md.with_suffix(".json").read_text())
    text = md.read_text()
    assert "python -m benchmarks.scoring " + " ".join(args) in text and "## Rescoring 3 hypotheses" in text
    assert list(raw["throughput"]) == ["1", "2"]
    for batch, t in raw["throughput"].items():
        assert set(t["tokens_per_s"]) == set(scoring.SIDES) and len(t["seconds"]["floor"]) == 1
        assert max(t["max_abs_nll_diff"].values()) < 1e-4
        assert f"| {batch} |" in text
    assert raw["rescoring"]["max_abs_nll_diff"] < 1e-5
    assert raw["beam"]["same_best"] and "## Beam search, k = 4: 4 tokens" in text


def test_the_floor_counts_what_the_graph_multiplies(tiny_ckpt):
    """Per layer only the new tokens are projected; the scores reach over the memory from the second segment on;
    the output layer runs at every position."""
    cfg = load_model(tiny_ckpt).config
    shapes = scoring.matmul_shapes(cfg, 2, 32, 16)
    S, H, Dh = 2 * cfg.n_head, cfg.n_head, cfg.d_head
    for segment, keys in ((shapes[:len(shapes) // 2], 16), (shapes[len(shapes) // 2:], 16 + min(16, cfg.mem_len))):
        body, output = segment[:7 * cfg.n_layer], segment[7 * cfg.n_layer:]
        assert body[:4] == [(1, 32, cfg.d_model, 3 * H * Dh), (S, 16, Dh, keys), (S, 16, Dh, keys), (S, 16, keys, Dh)]
        assert body == body[:7] * cfg.n_layer
        assert output and all(m == 32 for _, m, _, _ in output)
