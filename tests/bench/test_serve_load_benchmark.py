"""benchmarks/serve_load.py's library on the tiny model, a small run: every path measured, the tokens compared, the
session continuation timed, and a results file that names its command (so run_all.py includes it)."""

from __future__ import annotations

from benchmarks.harness import generating_command
from benchmarks.serve_load import results_file, run_benchmark


def test_a_small_run_measures_every_path_and_writes_a_results_file(tiny_onnx):
    result = run_benchmark(tiny_onnx, concurrency=3, tokens=4, prompt_len=5, threads=1, repeat=2, context=40,
                           follow_up=4, triton=False)
    assert set(result["paths"]) == {"serve", "in-process, batched"}
    serve = result["paths"]["serve"]
    assert serve["tokens_per_s"] > 0 and len(serve["ratio_to_batched_rounds"]) == 2
    assert serve["first_token_p50_ms"] > 0 and serve["p99_ms"] >= serve["p50_ms"] >= 0
    assert result["tokens_match"] == {"serve": True}
    assert [len(t) for t in serve["tokens"]] == [4, 4, 4]
    s = result["sessions"]["serve"]
    assert len(s["session_ttft_ms"]) == 2 and s["speedup"] > 0 and s["same_token"]
    assert "memory per session" in result["memory_per_session_log"]
    text = results_file([result], "python -m benchmarks.serve_load --model tiny.onnx")
    assert generating_command(text) == "python -m benchmarks.serve_load --model tiny.onnx"
    assert "| serve |" in text and "Session continuation" in text


def test_the_script_explains_itself():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "benchmarks.serve_load", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=root)
    assert out.returncode == 0 and "--context" in out.stdout and "--no-triton" in out.stdout
