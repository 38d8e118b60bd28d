"""Smoke test of the serving load benchmark (benchmarks/triton_load.py): a real tritonserver, two conversations.

Nothing is timed here; the test checks that the benchmark measures what it says (every field of its report is
there) and that the conversations it streams through the server produce exactly the in-process greedy tokens.
"""

from __future__ import annotations

import json

import pytest

from benchmarks import triton_load


@pytest.fixture(scope="module")
def bench(tritonserver):
    """The load benchmark's library, where a tritonserver is there for it to start."""
    return triton_load


def test_load_benchmark_reports_every_field_and_server_tokens_equal_in_process(bench, tiny_onnx):
    result = bench.run_benchmark(tiny_onnx, concurrency=[2], tokens=3, instances=[1], prompt_len=20, repeat=1)
    json.dumps(result)  # --json writes it as is
    for key in ("date", "machine", "versions", "model", "tokens", "concurrency", "instances", "server",
                "in_process", "in_process_batched", "tokens_match", "prompt_kind"):
        assert key in result, key
    assert result["versions"]["tritonserver"] and result["machine"]["cpus"] >= 1
    assert result["model"]["max_segment"] == 16  # prompts of 20 tokens went to the server in two pieces
    (srv,), (local,), (batched,) = result["server"], result["in_process"], result["in_process_batched"]
    for row in (srv, local, batched):
        # one round: tokens/s is its 2 conversations x 3 tokens over its wall time
        assert row["concurrency"] == 2 and len(row["wall_s_rounds"]) == 1
        assert row["tokens_per_s"] == pytest.approx(2 * 3 / row["wall_s_rounds"][0])
        assert 0 < row["p50_ms"] <= row["p99_ms"]
        assert row["latency_samples"] == 2 * (3 - 1)  # gaps between the 3 tokens of each of 2 conversations
        assert len(row["tokens"]) == 2 and all(len(t) == 3 for t in row["tokens"])
    # the server saw every request: 2 prompts x 2 pieces, 2 x 2 decode steps, and 2 END requests (its statistics
    # are read once they cover every request the clients completed: a read right after the round can miss the last)
    assert srv["instances"] == 1 and srv["client_requests"] == 2 * 2 + 2 * 2 + 2
    assert srv["server_requests"] == srv["client_requests"]
    # Triton's nanosecond counters, per request, in ms: a request waits and executes within its round
    assert srv["server_queue_ms"] + srv["server_execute_ms"] <= srv["wall_s_rounds"][0] * 1e3 and srv["mean_batch"] >= 1
    # no cross-talk and nothing lost on the wire: each conversation's tokens match the same conversation in-process
    assert srv["tokens"] == local["tokens"]
    assert result["tokens_match"] is True
    table = bench.markdown(result)
    assert table.count("| Triton gRPC | 1 | 2 |") == 1 and table.count("| in-process | - | 2 |") == 1
    assert "**yes**" in table


def test_load_benchmark_refuses_bad_settings_before_starting_anything(bench, tiny_onnx, tmp_path):
    from txl_deploy.errors import InputError

    with pytest.raises(InputError, match="--tokens must be at least 2"):
        bench.run_benchmark(tiny_onnx, concurrency=[1], tokens=1)
    existing = tmp_path / "out.json"
    existing.write_text("{}")
    assert bench.main(["--model", str(tiny_onnx), "--md", str(tmp_path / "out.md")]) == 2  # its JSON exists
    assert existing.read_text() == "{}"


def test_statistics_are_read_once_they_count_every_completed_request(monkeypatch):
    """Triton records a request in its statistics after the client has the response: a read right after a round
    could miss the last ones (seen on a loaded machine: 8 of 10). The benchmark waits until the count covers every
    request its clients completed, and still reports a real shortfall instead of waiting for ever."""
    module = triton_load

    class LaggingServer:  # counts 2 more requests on each statistics read, up to what was really served
        def __init__(self, served):
            self.served, self.seen = served, 0

        def get_inference_statistics(self, model, as_json):
            self.seen = min(self.served, self.seen + 2)
            return {"model_stats": [{"execution_count": self.seen,
                                     "inference_stats": {"success": {"count": self.seen, "ns": 5 * self.seen}}}]}

    class Client:
        def __init__(self, server):
            self._client = server

    before = {"requests": 0}
    assert module._stats_after(Client(LaggingServer(10)), "txl", before, sent=10)["requests"] == 10
    monkeypatch.setattr(module, "STATS_SETTLE_S", 0.1)  # a server that lost requests: the shortfall is reported
    assert module._stats_after(Client(LaggingServer(8)), "txl", before, sent=10)["requests"] == 8
