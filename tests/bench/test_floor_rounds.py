"""The bandwidth floor compares like with like: the copy bandwidth is measured in every round of the decode steps,
taking its turn in the rounds' alternating order, and each round's decode median is set against that round's own
floor. Nothing is timed against a target here."""

from __future__ import annotations

import numpy as np
import pytest

from txl_deploy.bench import timing
from txl_deploy.bench.bandwidth_floor import BandwidthProbe, decode_bytes, floor


class _Runtime:
    """Just enough of a TxlRuntime for `timing.run_pair`, logging the calls of its side."""

    def __init__(self, name, log):
        self.name, self.log, self.backend = name, log, None

    def prefill(self, tokens):
        self.log.append((self.name, "prefill"))
        return np.zeros((tokens.shape[0], 4), np.float32)

    def step(self, tokens):
        self.log.append((self.name, "step"))
        return np.zeros((tokens.shape[0], tokens.shape[1], 4), np.float32)

    def save_state(self):
        return {}

    def load_state(self, state):
        pass

    def reset(self):
        pass

    def close(self):
        pass


def test_the_probe_takes_a_turn_in_every_round_in_the_alternating_order():
    log = []
    sides = [timing.Side(name, lambda name=name: _Runtime(name, log), decode_only=True) for name in ("A", "B")]
    stream = timing.make_stream(4, 1, 3, 2, 1)

    def probe():
        log.append(("probe", "copy"))
        return float(len([e for e in log if e[0] == "probe"]))

    got = timing.run_pair(sides, stream, repeat=3, warmup=0, probe=probe)
    assert got == [1.0, 2.0, 3.0]
    turns = [e[0] for e in log if e[1] != "prefill"]  # the fills (untimed setup) come first
    assert turns[:15] == ["A", "A", "B", "B", "probe",  # round 1: the sides, then the probe
                          "probe", "B", "B", "A", "A",  # round 2: the same turns reversed
                          "A", "A", "B", "B", "probe"]
    assert turns[15:] == ["A", "A", "B", "B"]  # then each side's untimed memory pass
    # decode-only sides: the fill, then steps only, never a prompt's prefill
    assert [e for e in log if e[1] == "prefill"] == [("A", "prefill"), ("B", "prefill")]


def test_each_round_is_set_against_its_own_floor():
    class Config:  # the tiny shape's sizes are enough for the arithmetic
        d_model, n_head, d_head, d_inner, n_layer, d_embed = 8, 2, 4, 16, 2, 8
        n_clusters, cutoffs, div_val, n_token, clamp_len = 0, [], 1, 10, 0

    n_bytes = sum(decode_bytes(Config, 5, 1).get(k) for k in ("weight_bytes", "memory_bytes"))
    rounds = [(2e9, 3.0), (1e9, 5.0), (4e9, 2.0)]  # (copy bandwidth, decode median ms) of each round
    f = floor(Config, 5, 1, float(np.median([bw for bw, _ in rounds])), 3.0, rounds=rounds)
    assert f["bandwidth_rounds"] == [2e9, 1e9, 4e9]
    assert f["floor_ms"] == pytest.approx(n_bytes / 2e9 * 1e3)
    assert f["gap_rounds"] == pytest.approx([ms / (n_bytes / bw * 1e3) for bw, ms in rounds])
    assert "read_ms" not in f  # no read bandwidth measured, no read figures

    reads = [1.5e9, 0.5e9, 3e9]  # a pure read of each round, slower than its copy as on one thread here
    f = floor(Config, 5, 1, float(np.median([bw for bw, _ in rounds])), 3.0, rounds=rounds, read_rounds=reads)
    assert f["read_bandwidth_rounds"] == reads and f["read_bandwidth_bytes_per_s"] == 1.5e9
    assert f["read_ms"] == pytest.approx(n_bytes / 1.5e9 * 1e3)
    assert f["read_gap"] == pytest.approx(3.0 / f["read_ms"])
    assert f["read_over_floor"] == pytest.approx(2e9 / 1.5e9)  # how far the copy floor is below a pure read


def test_benchmark_reports_the_bandwidth_of_every_round(tiny_onnx, tiny_ckpt):
    from txl_deploy.bench import run_benchmark

    rep = run_benchmark(str(tiny_onnx), reference=str(tiny_ckpt), prompt_len=6, gen_len=4, repeat=3, warmup=1,
                        progress=False)
    f = rep["results"][0]["floor"]
    assert len(f["bandwidth_rounds"]) == len(f["gap_rounds"]) == 3
    assert f["bandwidth_bytes_per_s"] == pytest.approx(np.median(f["bandwidth_rounds"]))
    p50 = rep["results"][0]["sides"]["candidate"]["decode_ms"]["p50"]
    assert f["gap"] == pytest.approx(p50 / f["floor_ms"])
    assert len(f["read_bandwidth_rounds"]) == 3 and f["read_gap"] == pytest.approx(p50 / f["read_ms"])


def test_probe_measures_a_copy_larger_than_any_cache():
    probe = BandwidthProbe(nbytes=64 * 2**20, repeats=2)
    bw = probe()
    assert probe.src.nbytes == 64 * 2**20
    assert 1e8 < bw.copy < 1e13 and 1e8 < bw.read < 1e13  # bytes per second: read + write, and read only
