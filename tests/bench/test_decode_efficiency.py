"""The decode-efficiency report's logic on the tiny model: the ratios, the bytes a profiled node reads, and the
MatMuls run alone (no timing is asserted)."""

import numpy as np
import onnx

from benchmarks.step_bytes import (
    constant_input_bytes,
    efficiency,
    graph_step_bytes,
    input_bytes,
    interleaved_efficiency,
    matmul_alone,
    profile_nodes,
)
from txl_deploy.bench.bandwidth_floor import Bandwidth, BandwidthProbe
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend


def test_efficiency_sets_each_round_against_its_own_bandwidth():
    # 1 GB/s read and 2 GB/s copied (read + written) in round 0, both halved in round 1, where the step is twice
    # as slow: each round's ratios are 2 and 4, whatever the medians of the rounds' bandwidths say.
    rounds = [Bandwidth(copy=2e9, read=1e9), Bandwidth(copy=1e9, read=0.5e9)]
    r = efficiency(1_000_000, [2.0, 4.0], rounds)
    assert r["over_read"] == 2.0 and r["over_copy"] == 4.0
    assert np.isclose(r["read_ms"], 1e6 / 0.75e9 * 1e3) and np.isclose(r["copy_ms"], 1e6 / 1.5e9 * 1e3)
    assert r["step_ms"] == 3.0


def test_cpu_time_ratios_set_each_rounds_cpu_step_against_its_cpu_read_and_copy():
    # Round 1 waited for a core: its wall step and wall read are slow, its CPU times are those of round 0.
    rounds = [Bandwidth(copy=2e9, read=1e9, read_cpu=1e9, copy_cpu=2e9),
              Bandwidth(copy=0.5e9, read=0.25e9, read_cpu=1e9, copy_cpu=2e9)]
    r = efficiency(1_000_000, [2.0, 9.0], rounds, step_cpu_ms_rounds=[2.0, 2.0])
    assert r["over_read_cpu"] == 2.0 and r["over_copy_cpu"] == 4.0 and r["step_cpu_ms"] == 2.0
    assert np.isclose(r["read_cpu_ms"], 1.0) and np.isclose(r["copy_cpu_ms"], 0.5)
    assert "over_read_cpu" not in efficiency(1_000_000, [2.0], rounds[:1])  # no CPU times, no CPU ratios


def test_the_probe_times_its_read_and_copy_in_cpu_time_too():
    bw = BandwidthProbe(nbytes=16 * 2**20, repeats=1)()
    # CPU time never exceeds wall time on one thread: the CPU-time rates are at least the wall-time ones
    assert bw.read_cpu >= 0.9 * bw.read and bw.copy_cpu >= 0.9 * bw.copy  # (the two clocks differ by a little)


def test_interleaved_efficiency_alternates_sides_and_probes_every_round():
    calls = []
    sides = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}

    def probe():
        calls.append("probe")
        return Bandwidth(copy=2e9, read=1e9)

    out = interleaved_efficiency(sides, {"a": 10, "b": 20}, probe, rounds=2, steps_per_round=2)
    assert calls == ["a", "a", "b", "b", "probe", "probe", "b", "b", "a", "a"]  # the order reversed every round
    assert set(out) == {"a", "b"} and out["b"]["bytes"] == 20 and len(out["a"]["step_ms_rounds"]) == 2
    assert len(out["a"]["step_cpu_ms_rounds"]) == 2  # every step is timed on the thread's CPU clock too


def test_step_bytes_count_every_weight_product_and_the_memory(tiny_onnx):
    b = graph_step_bytes(tiny_onnx)
    graph = onnx.load(str(tiny_onnx)).graph
    matrices = sum(np.prod(t.dims) * 4 for t in graph.initializer if len(t.dims) == 2)
    assert b["weights"] >= 0.5 * matrices  # the body's and the output layer's products
    assert b["total"] == b["weights"] + b["positional_tables"] + b["memory"] and b["memory"] > 0


def test_input_bytes_take_constants_from_the_graph_and_activations_from_the_profile():
    event = {"args": {"input_type_shape": [{"float": [1, 1, 8]}, {"float": [8, 16]}, {"int64": [2]}]}}
    assert input_bytes(event) == 32 + 512 + 16
    assert input_bytes(event, {1: 1000}) == 32 + 1000 + 16  # a prepacked weight's listed shape is not used


def test_profile_nodes_and_matmuls_alone_on_the_tiny_model(tiny_onnx):
    with TxlRuntime(OrtBackend(tiny_onnx, providers=["cpu"], intra_op_threads=1)) as rt:
        rt.prefill(np.arange(rt.mem_len).reshape(1, -1) % rt.n_token)
        state = {k: v for k, v in rt.save_state().items() if not k.startswith("__")}
        n_token = rt.n_token
    prof = profile_nodes(tiny_onnx, state, np.arange(7).reshape(1, -1) % n_token, threads=1, steps=3)
    assert prof["nodes"] and prof["ops"]
    assert sum(o["nodes"] for o in prof["ops"]) == len(prof["nodes"])
    assert abs(sum(o["ms_per_step"] for o in prof["ops"]) - prof["kernel_ms"]) < 1e-6
    constants = constant_input_bytes(tiny_onnx)
    weighted = [n for n in prof["nodes"]
                if n["op_type"] in ("MatMul", "Gemm", "FusedGemm") and constants.get(n["name"])]
    assert {n["op_type"] for n in weighted} >= {"MatMul", "FusedGemm"}, "the profile's product names are the graph's"
    for n in weighted:
        assert n["bytes"] >= sum(constants[n["name"]].values())
    alone = matmul_alone(tiny_onnx, [n["name"] for n in weighted], threads=1, runs=3)
    graph = onnx.load(str(tiny_onnx)).graph
    sizes = {t.name: np.prod(t.dims) * 4 for t in graph.initializer}
    by_name = {node.name: node for node in graph.node}
    for name, r in alone.items():
        assert r["ms"] > 0 and r["b_bytes"] == sizes[by_name[name].input[1]]
