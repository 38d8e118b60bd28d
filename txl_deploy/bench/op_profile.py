"""Where a decode step's time goes: ONNX Runtime's own profiler over `steps` decode steps from a full memory,
summed per op type, the median step reported, with each step's CPU time on its thread beside the session's time
(on a shared machine the difference is time spent waiting for a core)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict

import numpy as np

from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend


def profile_decode(onnx_path, state: dict, tokens: np.ndarray, threads: int | None = None, steps: int = 5,
                   providers=("cpu",)) -> dict:
    """{"step_ms", "ops": [{op_type, ms_per_step, share, calls_per_step}] slowest first} from the saved memory
    `state`, `tokens` [B, >= steps + 1] fed one per step."""
    runs, events, cpu = trace_steps(onnx_path, state, tokens, threads, steps, providers)
    per_step = [defaultdict(float) for _ in runs]
    calls = defaultdict(int)
    for k, e in node_events(runs, events):
        op = e.get("args", {}).get("op_name", "?")
        per_step[k][op] += e["dur"] / 1e3
        calls[op] += 1
    ops_seen = {op for step in per_step for op in step}
    by_op = {op: float(np.median([step.get(op, 0.0) for step in per_step])) for op in ops_seen}
    node_total = sum(by_op.values()) or 1.0
    step_ms = float(np.median([(b - a) / 1e3 for a, b in runs])) if runs else 0.0
    ops = [{"op_type": op, "ms_per_step": ms, "share": ms / node_total, "calls_per_step": calls[op] / max(len(runs), 1)}
           for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1])]
    return {"step_ms": step_ms, "step_cpu_ms": float(np.median(cpu)), "kernel_ms": node_total, "ops": ops}


def trace_steps(onnx_path, state, tokens, threads, steps, providers) -> tuple[list, list, list]:
    """The steady-state runs [(start, end) us], all events of a profiled session's decode steps, and each step's
    CPU time on the calling thread (ms)."""
    with tempfile.TemporaryDirectory(prefix="txl-profile-") as tmp:
        backend = OrtBackend(onnx_path, providers=list(providers), intra_op_threads=threads,
                             profile_prefix=os.path.join(tmp, "ort"))
        rt = TxlRuntime(backend)
        rt.load_state({**state, "__fingerprint__": np.array(backend.fingerprint())})
        rt.step(tokens[:, :1])  # the first run of a session allocates: dropped from the summary below
        cpu = []
        for t in range(1, steps + 1):
            c0 = time.thread_time()
            rt.step(tokens[:, t:t + 1])
            cpu.append(1e3 * (time.thread_time() - c0))
        trace_path = backend.session.end_profiling()
        with open(trace_path) as f:
            events = json.load(f)
        rt.close()
    # One steady-state step is the median over steps, per op: a shared machine's scheduler stalls land on
    # whichever op was running and would otherwise be charged to it.
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                  if e.get("cat") == "Session" and e.get("name") == "model_run")[1:]
    return runs, events, cpu


def node_events(runs, events):
    """(run index, event) of every kernel's event inside a steady-state run."""
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        k = next((i for i, (a, b) in enumerate(runs) if a <= e["ts"] <= b), None)
        if k is not None:
            yield k, e


def profile_table(prof: dict, top: int = 12) -> str:
    cpu = f", {prof['step_cpu_ms']:.2f} ms of CPU time on its thread" if "step_cpu_ms" in prof else ""  # (older runs)
    lines = [f"one decode step: {prof['step_ms']:.2f} ms in the session{cpu} ({prof['kernel_ms']:.2f} ms in kernels)",
             f"{'op type':<24}{'ms/step':>10}{'share':>8}{'calls':>7}"]
    for op in prof["ops"][:top]:
        lines.append(f"{op['op_type']:<24}{op['ms_per_step']:>10.3f}{op['share']:>8.1%}{op['calls_per_step']:>7.0f}")
    return "\n".join(lines)


