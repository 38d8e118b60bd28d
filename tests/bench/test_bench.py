"""`txl-deploy bench`: it runs, its JSON has the documented fields, and both sides computed the same log-probs.

Speed is never asserted here (no timed tests): targets are shown by the benchmark itself (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from helpers.distributions import mean_kl
from helpers.paths import ROOT

from txl_deploy.cli import main

FAST = ["--prompt-len", "6", "--gen-len", "4", "--repeat", "2", "--warmup", "1", "--quiet"]
SIDE_FIELDS = {"backend", "decode_ms", "decode_tokens_per_s", "prefill_ms", "prefill_tokens_per_s",
               "peak_memory_bytes", "loaded_memory_bytes", "memory_kind"}


def _bench(args):
    result = CliRunner().invoke(main, ["bench", *args, *FAST])
    return result


def test_onnx_against_eager_json_fields_and_parity(tiny_onnx, tiny_ckpt, tmp_path):
    out = tmp_path / "bench.json"
    res = _bench([str(tiny_onnx), "--reference", str(tiny_ckpt), "--batch", "1,2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "onnxruntime" in res.output and "torch (eager)" in res.output and "max abs diff" in res.output
    report = json.loads(out.read_text())
    assert report["schema"] == "txl-deploy-bench/1" and report["source"] == "onnx"
    assert {"model", "date", "machine", "versions", "settings", "config", "results"} <= set(report)
    assert {"cpu", "cores", "platform", "gpu"} <= set(report["machine"])
    assert report["settings"]["gen_len"] == 4 and report["settings"]["baseline"] == "eager"
    assert [(r["mem_len"], r["batch"]) for r in report["results"]] == [(12, 1), (12, 2)]
    for r in report["results"]:
        assert set(r["sides"]) == {"candidate", "baseline"}
        for side in r["sides"].values():
            assert SIDE_FIELDS <= set(side)
            d = side["decode_ms"]
            assert d["n"] == 4 * 2 and 0 < d["min"] <= d["p50"] <= d["p90"] <= d["p99"]
            assert side["decode_tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / d["p50"])
            assert side["prefill_tokens_per_s"] == pytest.approx(r["batch"] * 6 * 1e3 / side["prefill_ms"])
        assert set(r["speedup"]) == {"decode_p50", "decode_tokens_per_s", "prefill"}
        # the prefill's last position and every decode step, for every row
        assert r["parity"]["positions"] == r["batch"] * (1 + 4)
        assert r["parity"]["max_abs_diff"] <= 1e-4 and r["parity"]["top1_agreement"] == 1.0
        f = r["floor"]  # the floor is the bytes a step reads over the measured bandwidth; the gap is against it
        assert f["floor_ms"] == pytest.approx((f["weight_bytes"] + f["memory_bytes"]) / f["bandwidth_bytes_per_s"] * 1e3)
        assert f["gap"] == pytest.approx(r["sides"]["candidate"]["decode_ms"]["p50"] / f["floor_ms"])
        assert f["memory_bytes"] == r["batch"] * 2 * 2 * 2 * 8 * 12 * 4  # rows x layers x (k, v) x heads x d_head x slots


def test_checkpoint_is_exported_on_the_fly_at_each_mem_len(tiny_ckpt, tmp_path):
    out = tmp_path / "b.json"
    res = _bench([str(tiny_ckpt), "--mem-len", "5,20", "--json", str(out)])
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["source"] == "checkpoint" and [r["mem_len"] for r in report["results"]] == [5, 20]
    for r in report["results"]:  # the ring wraps (mem_len 5 < the 6-token prompt) and the numbers still agree
        assert r["parity"]["max_abs_diff"] <= 1e-4


def test_torch_fast_backend_matches_eager(tiny_ckpt, tmp_path):
    out = tmp_path / "f.json"
    res = _bench([str(tiny_ckpt), "--backend", "torch-fast", "--batch", "2", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"][0]
    assert r["sides"]["candidate"]["backend"] == "torch-fast"
    assert r["parity"]["max_abs_diff"] <= 1e-4


def test_without_baseline(tiny_onnx, tmp_path):
    out = tmp_path / "n.json"
    res = _bench([str(tiny_onnx), "--baseline", "none", "--profile", "--json", str(out)])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())["results"][0]
    assert set(r["sides"]) == {"candidate"} and r["speedup"] is None and r["parity"] is None
    assert "one decode step" in res.output and "MatMul" in res.output
    assert {"step_ms", "kernel_ms", "ops"} <= set(r["profile"])


def test_parity_reports_a_difference():
    """The comparison is real: sides that disagree show it (a shifted log-prob, a different argmax, another
    distribution: its KL divergence from the baseline's, as tests/helpers computes it)."""
    from txl_deploy.bench.timing import Side, parity

    a, b = Side("a", None), Side("b", None)
    a.log_probs = [np.log(np.full((2, 4), 0.25, np.float32))]
    b.log_probs = [a.log_probs[0].copy()]
    assert parity(a, b) == {"max_abs_diff": 0.0, "kl_divergence": 0.0, "top1_agreement": 1.0, "positions": 2}
    b.log_probs[0][1, 3] += 0.5
    p = parity(a, b)
    assert p["max_abs_diff"] == pytest.approx(0.5) and p["top1_agreement"] == 0.5
    # over several steps (the list) and rows, the mean per position, KL(b || a)
    logits = np.random.default_rng(0).normal(size=(2, 2, 2, 5))  # side, step, row, word
    log_probs = (logits - np.log(np.exp(logits).sum(-1, keepdims=True))).astype(np.float32)
    a.log_probs, b.log_probs = list(log_probs[0]), list(log_probs[1])
    want = mean_kl(np.stack(b.log_probs), np.stack(a.log_probs))
    assert want > 0.1 and parity(a, b)["kl_divergence"] == pytest.approx(want, rel=1e-6)
    a.log_probs[1][0, 2] = -np.inf  # a word the side rules out and the baseline does not: infinitely far
    assert parity(a, b)["kl_divergence"] == float("inf")
    a.log_probs, b.log_probs = [np.log(np.full((2, 4), 0.25, np.float32))], [np.log(np.full((2, 4), 0.25, np.float32))]
    b.log_probs[0][0, 0] = -np.inf  # a position one side masks and the other does not
    assert parity(a, b)["max_abs_diff"] == float("inf")


def test_bad_input_is_one_line(tiny_onnx, tiny_ckpt, tmp_path):
    runner = CliRunner()
    cases = [
        ([str(tiny_onnx)], "--reference"),  # eager baseline without the checkpoint
        ([str(tiny_onnx), "--reference", str(tiny_ckpt), "--mem-len", "30"], "fixed at 12"),
        (["no-such-model"], "not a published shape name"),
        ([str(tiny_onnx), "--backend", "tensorrt", "--baseline", "none"], "engine"),
        ([str(tiny_ckpt), "--batch", "0"], "integers >= 1"),
    ]
    for args, needle in cases:
        res = runner.invoke(main, ["bench", *args, *FAST])
        assert res.exit_code == 2, (args, res.output)
        assert needle in res.output and "Traceback" not in res.output
    existing = tmp_path / "exists.json"
    existing.write_text("{}")
    res = runner.invoke(main, ["bench", str(tiny_onnx), "--baseline", "none", "--json", str(existing), *FAST])
    assert res.exit_code == 2 and "already exists" in res.output and existing.read_text() == "{}"


def test_plot(tiny_onnx, tmp_path):
    out = tmp_path / "p.png"
    res = _bench([str(tiny_onnx), "--baseline", "none", "--plot", str(out)])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res.exit_code == 2 and "needs matplotlib" in res.output and not out.exists()
        return
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_decode_bytes_count_the_output_layer_and_memory():
    from helpers.tiny import make_tiny_model

    from txl_deploy.bench.bandwidth_floor import decode_bytes

    model = make_tiny_model()
    cfg = model.cfg
    crit = sum(p.numel() for p in model.crit.parameters()) * 4
    b = decode_bytes(cfg, mem_len=12, batch=3, table_size=10)
    assert b["output_layer_bytes"] == crit
    assert b["memory_bytes"] == 3 * cfg.n_layer * 2 * cfg.n_head * cfg.d_head * 12 * 4
    body = sum(p.numel() for n, p in model.layers.named_parameters() if "r_net" not in n) * 4
    table = cfg.n_layer * cfg.n_head * cfg.d_head * 10 * 4
    biases = cfg.n_layer * 2 * cfg.n_head * cfg.d_head * 4
    assert b["weight_bytes"] == body + table + biases + crit + 3 * cfg.d_model * 4


def test_profile_summarises_a_decode_step(tiny_onnx):
    from txl_deploy.bench.op_profile import profile_decode
    from txl_deploy.runtimes import TxlRuntime

    rt = TxlRuntime.load(tiny_onnx)
    tokens = np.random.default_rng(0).integers(0, 60, (1, 20))
    rt.prefill(tokens[:, :14])
    state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
    prof = profile_decode(tiny_onnx, state, tokens[:, 14:], threads=1, steps=3)
    ops = {o["op_type"]: o for o in prof["ops"]}
    assert "MatMul" in ops and ops["MatMul"]["calls_per_step"] >= 2 * 2  # at least q@K and p@V per layer
    assert sum(o["share"] for o in prof["ops"]) == pytest.approx(1.0)
    # every op runs inside the step, so no op's median can exceed the step's median
    assert max(o["ms_per_step"] for o in prof["ops"]) <= prof["step_ms"]


def test_cached_exports_follow_the_checkpoint(tiny_ckpt, tmp_path):
    """A checkpoint retrained in place must not be benchmarked through its stale cached export."""
    import os
    import shutil

    from txl_deploy.bench.random_weights import _content_key

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    before = _content_key(ckpt)
    assert _content_key(ckpt) == before
    weights = next(p for p in ckpt.iterdir() if p.suffix == ".safetensors")
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert _content_key(ckpt) != before


def test_eager_baseline_applies_the_output_layer_at_the_requested_positions_only(tiny_ckpt):
    """The fair baseline is the same model: at the positions asked for it gives eager-as-written's log-probs, on a
    multi-segment stream, batched and with rows of different memory lengths; it just never computes the others."""
    from txl_deploy.bench.eager_baseline import EagerAtPositions
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.backends.pytorch import TorchEagerBackend

    fair = TxlRuntime(EagerAtPositions.from_checkpoint(tiny_ckpt))
    as_written = TxlRuntime(TorchEagerBackend.from_checkpoint(tiny_ckpt))
    tokens = np.random.default_rng(3).integers(0, 60, (2, 40))
    for rt in (fair, as_written):
        rt.prefill(tokens[:, :7])
    seen = []
    real_crit = fair.backend.model.crit.forward
    fair.backend.model.crit.forward = lambda h: seen.append(tuple(h.shape)) or real_crit(h)
    for a, b in ((0, 7), (7, 8), (8, 20), (20, 21)):  # segments and decode steps, the memory wrapping (mem_len 12)
        np.testing.assert_allclose(fair.prefill(tokens[:, a + 7:b + 7]), as_written.prefill(tokens[:, a + 7:b + 7]),
                                   atol=1e-5)
    assert seen == [(2, 1, 32)] * 4  # the output layer saw one position per row, never the whole segment
    np.testing.assert_allclose(fair.step(tokens[:, 30:33]), as_written.step(tokens[:, 30:33]), atol=1e-5)
    for rt in (fair, as_written):  # rows diverge: row 0 starts over, so the rows run one at a time
        rt.reset([0])
    np.testing.assert_allclose(fair.step(tokens[:, 33:36]), as_written.step(tokens[:, 33:36]), atol=1e-5)


def test_eager_as_written_column_and_compared_graph(tiny_onnx, tiny_ckpt, tmp_path):
    out = tmp_path / "w.json"
    res = _bench([str(tiny_onnx), "--reference", str(tiny_ckpt), "--eager-as-written", "--compare", str(tiny_onnx),
                  "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "torch (eager, as written)" in res.output and "against eager as written" in res.output
    assert "against onnxruntime (fp32)" in res.output
    r = json.loads(out.read_text())["results"][0]
    assert set(r["sides"]) == {"candidate", "baseline", "eager_as_written", "compare"}
    aw = r["sides"]["eager_as_written"]
    assert aw["backend"] == "torch (eager, as written)" and aw["decode_ms"] is None  # prefill only
    assert r["speedup"]["prefill_vs_as_written"] == pytest.approx(aw["prefill_ms"] / r["sides"]["candidate"]["prefill_ms"])
    assert r["as_written_parity"]["max_abs_diff"] <= 1e-5 and r["as_written_parity"]["positions"] == 1
    assert r["sides"]["compare"]["decode_ms"]["n"] == 4 * 2
    assert r["speedup_vs_compare"]["decode_p50"] == pytest.approx(
        r["sides"]["compare"]["decode_ms"]["p50"] / r["sides"]["candidate"]["decode_ms"]["p50"])
    assert r["compare_parity"]["max_abs_diff"] <= 1e-6  # the same graph on the same stream


def test_peak_memory_counts_a_rise_freed_before_the_call_ends(tiny_onnx, tiny_ckpt):
    """The kernel's high-water mark, reset before each call, sees a transient allocation that is gone by the end
    (a sampler could miss it); the benchmark's sides report a peak at least what loading left resident."""
    import numpy as np

    from txl_deploy.bench import run_benchmark
    from txl_deploy.bench.peak_usage import PeakMemory

    mem = PeakMemory()
    with mem.call():
        block = np.ones(64 << 20, dtype=np.uint8)  # 64 MiB, touched
        del block
    assert mem.transient >= 60 << 20
    with mem.call():
        pass
    assert mem.transient >= 60 << 20  # the largest rise is kept
    rep = run_benchmark(str(tiny_onnx), reference=str(tiny_ckpt), prompt_len=6, gen_len=4, repeat=2, warmup=1,
                        floor=False, progress=False)
    for side in rep["results"][0]["sides"].values():
        assert side["decode_ms"]["n"] == 8 and side["peak_memory_bytes"] >= side["loaded_memory_bytes"]


def _run_all_module():
    from benchmarks import run_all

    return run_all


def test_results_md_is_generated_whole_and_takes_in_every_generated_results_file(tiny_onnx, tiny_ckpt, tmp_path,
                                                                              monkeypatch):
    """RESULTS.md = run_all's own tables + every benchmarks/results_*.md that names the command that wrote it; a
    hand-written one is listed as left out, not pasted in."""
    from benchmarks.harness import generating_command, results_markdown
    from txl_deploy.bench import run_benchmark

    run_all = _run_all_module()
    monkeypatch.setattr(run_all, "HERE", tmp_path)
    (tmp_path / "results_zz_new.md").write_text(results_markdown("A later benchmark", "| a |\n|---|\n| 1.5 |",
                                                                 "python benchmarks/zz.py --fast"))
    (tmp_path / "results_by_hand.md").write_text("# Notes\n\nTyped in.\n")
    assert generating_command((tmp_path / "results_zz_new.md").read_text()) == "python benchmarks/zz.py --fast"
    rep = run_benchmark(str(tiny_onnx), reference=str(tiny_ckpt), prompt_len=6, gen_len=4, repeat=2, warmup=1,
                        as_written_batches=(1,), progress=False)
    rep["name"] = "tiny"
    text = run_all.results_md([rep], "memory bandwidth: not measured", "python benchmarks/run_all.py")
    assert text.startswith("# Benchmark results\n\nWritten by `python benchmarks/run_all.py`")
    assert "## tiny" in text and "torch (eager, as written)" in text
    assert "## A later benchmark" in text and "| 1.5 |" in text  # one heading level down, content as written
    assert "Typed in." not in text and "`benchmarks/results_by_hand.md`: it does not say which command" in text


def test_run_all_scripts_regenerate_every_shipped_results_file():
    """`run_all.py --scripts all` runs a script for every benchmarks/results_*.md, and each script it names exists."""
    from benchmarks.harness import generating_command

    run_all = _run_all_module()
    scripts = {f"benchmarks.{command[0]}" for command in run_all.SCRIPTS.values()}
    assert all((ROOT / f"{s.replace('.', '/')}.py").is_file() for s in scripts), scripts
    for part in sorted((ROOT / "benchmarks").glob("results_*.md")):
        wrote = generating_command(part.read_text()).split()[2]  # "python -m benchmarks.NAME ..."
        assert wrote in scripts, f"{part.name} was written by {wrote}, which --scripts all does not run"


def test_shipped_results_name_their_commands_and_no_issue_numbers():
    """What a user reads about the benchmarks: every results file says which command wrote it, and neither they nor
    the benchmark scripts' --help mention how the work was organised (issue numbers)."""
    import re
    import subprocess
    import sys

    from benchmarks.harness import generating_command

    bench_dir = ROOT / "benchmarks"
    parts = sorted(bench_dir.glob("results_*.md"))
    for part in parts:
        assert generating_command(part.read_text()), f"{part.name} does not name the command that wrote it"
    texts = {p.name: p.read_text() for p in [bench_dir / "RESULTS.md", *parts, *bench_dir.glob("*.md")]}
    for script in ("run_all", "precision", "triton_load", "paper_table9", "peers"):
        out = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--help"], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        texts[f"{script} --help"] = out.stdout
    for name, text in texts.items():
        assert not re.search(r"\bissues?\s*#?\d", text, re.IGNORECASE), name
    results = texts["RESULTS.md"]
    assert "Left out" not in results  # every shipped results file was taken in
    assert all(f"benchmarks/{p.name}, written by" in results for p in parts)
