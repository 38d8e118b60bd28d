"""The serving benchmark's results file lets two runs be compared: every round of every row, the spread (min /
median / max) of each configuration, and everything the run depended on; and a run without --model is the
configuration the documentation quotes. No server runs here (tests/test_triton_load.py runs one)."""

from __future__ import annotations

from benchmarks import triton_load
from benchmarks.harness import generating_command


def _row(c, rates, **extra):
    return {"concurrency": c, "tokens_per_s": sorted(rates)[len(rates) // 2], "tokens_per_s_rounds": rates,
            "p50_ms": 10.0, "p99_ms": 20.0, "mean_ms": 11.0, "first_token_p50_ms": 50.0, **extra}


def _result(queue_delay_us=10000):
    server = _row(16, [80.0, 95.0, 70.0], instances=1, ratio_to_batched=0.8,
                  ratio_to_batched_rounds=[0.9, 0.8, 0.61], server_queue_ms=3.0, server_execute_ms=90.0,
                  mean_batch=14.2)
    return {"date": "2026-12-01 08:34 UTC", "tokens": 64, "prompt_len": 48, "prompt_kind": "random ids",
            "concurrency": [16], "instances": [1], "max_batch": 16, "queue_delay_us": queue_delay_us, "repeat": 3,
            "threads": 1, "load_average_rounds": [3.25, 4.5, 2.0],
            "machine": {"cpus": 2, "cpu": "Some CPU", "system": "Linux 6", "load_average_start": [3.0, 2, 1],
                        "load_average_end": [5.0, 2, 1]},
            "versions": {"python": "3.11", "txl-deploy": "0.1.0", "tritonserver": "2.51.0", "tritonclient": "2.73.0",
                         "onnxruntime": "1.32.0", "numpy": "2.4", "grpcio": "1.85"},
            "model": {"label": "enwik8-base shape, random weights", "file": "e.onnx", "n_token": 204, "n_layer": 12,
                      "d_model": 512, "mem_len": 512, "max_segment": 64},
            "server": [server], "in_process": [_row(16, [30.0, 38.0, 36.0])],
            "in_process_batched": [_row(16, [89.0, 118.0, 115.0])], "tokens_match": True,
            "batched_tokens_match": True}


def test_every_round_the_spread_and_every_setting_are_in_the_results_file():
    text = triton_load.results_file([_result()], "python -m benchmarks.triton_load --repeat 3")
    assert generating_command(text) == "python -m benchmarks.triton_load --repeat 3"
    # every round of every path, and the min / median / max of each
    assert "| Triton gRPC, tokens/s | 1 | 16 | 80 | 95 | 70 | 70 / 80 / 95 |" in text
    assert "| in-process batched, tokens/s | - | 16 | 89 | 118 | 115 | 89 / 115 / 118 |" in text
    assert "| Triton / in-process batched | 1 | 16 | 90% | 80% | 61% | **61% / 80% / 90%** |" in text
    assert "min / median / max over 3 rounds: 61% / 80% / 90%" in text
    for line in ("| ONNX Runtime threads | 1, in-process and per server instance |",
                 "| sequence batcher max_queue_delay | 10000 us |", "| max_batch | 16 |",
                 "| prompt | 48 tokens per conversation (random ids) |",
                 "| tokens generated | 64 greedy tokens per conversation, one request each |",
                 "| conversations (concurrency) | 16 |", "| rounds | 3 per row, interleaved |",
                 "| load average (1 min) | 3.0 at the start, 5.0 at the end; round by round: 3.2, 4.5, 2.0 |",
                 "| machine | 2 CPU cores (Some CPU, Linux 6) |", "tritonserver 2.51.0", "grpcio 1.85"):
        assert line in text, line
    assert "enwik8-base shape, random weights (`e.onnx`: 12 layers, d_model 512, mem_len 512" in text


def test_a_run_without_model_is_the_documented_configuration(monkeypatch, tmp_path):
    script = triton_load
    calls = []

    def fake(model, concurrency, tokens, instances, prompt_len, max_batch, delay, repeat, **kw):
        calls.append((model, delay, tokens, prompt_len, list(concurrency), repeat))
        return _result(delay)

    monkeypatch.setattr(script, "run_benchmark", fake)
    assert script.main(["--md", str(tmp_path / "a.md")]) == 0
    assert calls == [("enwik8-base", 10000, 64, 48, [1, 16], 5), (None, 4000, 64, 48, [1, 16], 5)]
    calls.clear()
    assert script.main(["--model", "x.onnx", "--md", str(tmp_path / "b.md")]) == 0  # another model: triton-repo's own delay
    assert calls == [("x.onnx", 1000, 64, 48, [1, 16], 5)]
