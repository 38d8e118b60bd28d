"""Where a decode step's time goes: ONNX Runtime's own profiler, summarised by operator type.

A separate session with `SessionOptions.enable_profiling` runs `steps` decode steps from the given state (a full
memory); the trace's node events are summed per op type and step, and the median step is reported.

A step's time in the session (the trace's model_run) can exceed the sum of its kernels' by far on a shared machine:
the kernels are summed as per-node medians over the steps, which leave out a stall wherever it landed, and the
thread also waits for a core between kernels. Each step's CPU time on its thread (`step_cpu_ms`, one intra-op
thread runs the graph on the caller's thread) tells the two apart: wall minus CPU is time spent waiting for a core.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from txl_deploy.runtimes import TxlRuntime
from txl_deploy.runtimes.backends.onnxruntime import OrtBackend


def profile_decode(onnx_path, state: dict, tokens: np.ndarray, threads: int | None = None, steps: int = 5,
                   providers=("cpu",)) -> dict:
    """state: the runtime's saved memory arrays (a full memory); tokens [B, >= steps + 1] fed one per step.

    Returns {"step_ms", "ops": [{op_type, ms_per_step, share, calls_per_step}] slowest first}."""
    runs, events, cpu = _trace(onnx_path, state, tokens, threads, steps, providers)
    per_step = [defaultdict(float) for _ in runs]
    calls = defaultdict(int)
    for k, e in _node_events(runs, events):
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


def _trace(onnx_path, state, tokens, threads, steps, providers) -> tuple[list, list, list]:
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


def _node_events(runs, events):
    """(run index, event) of every kernel's event inside a steady-state run."""
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        k = next((i for i, (a, b) in enumerate(runs) if a <= e["ts"] <= b), None)
        if k is not None:
            yield k, e


# Bytes per element of the type names ONNX Runtime's profiler writes in a node's input_type_shape.
PROFILE_TYPE_BYTES = {"float": 4, "float16": 2, "double": 8, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}


def input_bytes(event, constants=None) -> int:
    """The bytes a profiled kernel reads: its activations from its input_type_shape, and its constant inputs
    from the graph (`constants`: {input position: bytes}), since a weight ONNX Runtime prepacked at load is not
    always listed with its shape."""
    constants = constants or {}
    total = sum(constants.values())
    for i, entry in enumerate(event.get("args", {}).get("input_type_shape", [])):
        if i in constants:
            continue
        for type_name, dims in entry.items():
            total += int(np.prod(dims, dtype=np.int64)) * PROFILE_TYPE_BYTES.get(type_name, 4)
    return total


def constant_input_bytes(onnx_path) -> dict:
    """{node name: {input position: bytes}} of the initializers each node of the graph reads."""
    graph = onnx.load(str(onnx_path)).graph
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in graph.initializer}
    return {n.name: {i: sizes[x] for i, x in enumerate(n.input) if x in sizes} for n in graph.node}


def profile_nodes(onnx_path, state: dict, tokens: np.ndarray, threads: int | None = None, steps: int = 5,
                  providers=("cpu",)) -> dict:
    """Like `profile_decode`, per node: {"step_ms", "nodes": [{name, op_type, ms_per_step, bytes}] slowest first,
    "ops": [{op_type, ms_per_step, bytes, gb_per_s, nodes}]}, bytes being what the node reads per step (its
    inputs, the initializers among them) and GB/s those bytes over its time."""
    runs, events, cpu = _trace(onnx_path, state, tokens, threads, steps, providers)
    constants = constant_input_bytes(onnx_path)
    per_step = [defaultdict(float) for _ in runs]
    info = {}
    for k, e in _node_events(runs, events):
        # A node ONNX Runtime fused with its activation (Gemm + Relu: FusedGemm) is named "fused <graph node name>"
        name = e["name"][:-len("_kernel_time")].removeprefix("fused ")
        per_step[k][name] += e["dur"] / 1e3
        info[name] = (e.get("args", {}).get("op_name", "?"), input_bytes(e, constants.get(name)))
    nodes = [{"name": n, "op_type": info[n][0], "bytes": info[n][1],
              "ms_per_step": float(np.median([step.get(n, 0.0) for step in per_step]))} for n in info]
    nodes.sort(key=lambda n: -n["ms_per_step"])
    ops = defaultdict(lambda: {"ms_per_step": 0.0, "bytes": 0, "nodes": 0})
    for n in nodes:
        o = ops[n["op_type"]]
        o["ms_per_step"] += n["ms_per_step"]
        o["bytes"] += n["bytes"]
        o["nodes"] += 1
    op_rows = [{"op_type": op, **o, "gb_per_s": o["bytes"] / max(o["ms_per_step"], 1e-9) / 1e6}
               for op, o in sorted(ops.items(), key=lambda kv: -kv[1]["ms_per_step"])]
    step_ms = float(np.median([(b - a) / 1e3 for a, b in runs])) if runs else 0.0
    return {"step_ms": step_ms, "step_cpu_ms": float(np.median(cpu)), "kernel_ms": sum(n["ms_per_step"] for n in nodes),
            "nodes": nodes, "ops": op_rows}


def profile_table(prof: dict, top: int = 12) -> str:
    cpu = f", {prof['step_cpu_ms']:.2f} ms of CPU time on its thread" if "step_cpu_ms" in prof else ""  # (older runs)
    lines = [f"one decode step: {prof['step_ms']:.2f} ms in the session{cpu} ({prof['kernel_ms']:.2f} ms in kernels)",
             f"{'op type':<24}{'ms/step':>10}{'share':>8}{'calls':>7}"]
    for op in prof["ops"][:top]:
        lines.append(f"{op['op_type']:<24}{op['ms_per_step']:>10.3f}{op['share']:>8.1%}{op['calls_per_step']:>7.0f}")
    return "\n".join(lines)


def _constant(graph, name):
    """The value of a MatMul's B when it is an initializer or an initializer's Transpose (a tied output layer
    that ONNX Runtime folds once at load), else None."""
    inits = {t.name: t for t in graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = next((n for n in graph.node if name in n.output), None)
    if node is not None and node.op_type == "Transpose" and node.input[0] in inits:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        return np.transpose(numpy_helper.to_array(inits[node.input[0]]), perm)
    return None


# Read between the runs of `matmul_alone` so that each run finds its weight in memory, not in a cache, as it does in a
# decode step (which reads hundreds of MB between two reads of one weight). Larger than the last-level caches of the
# machines measured here (32 MB).
EVICT_BYTES = 128 * 2**20


def matmul_alone(onnx_path, names, threads: int = 1, runs: int = 30) -> dict:
    """Each named weight product of the graph (MatMul, or Gemm with its transB and bias) run alone: a one-node model
    with the same constant B, fed one token's activation, median ms of `runs` runs, the models taking turns run by
    run, each run after a read of EVICT_BYTES so that its weight comes from memory as in a step. Names whose B is
    not a constant are left out."""
    import onnxruntime as ort  # optional (the cpu extra): only the ONNX Runtime benchmarks get here

    graph = onnx.load(str(onnx_path)).graph
    by_name = {n.name: n for n in graph.node if n.op_type in ("MatMul", "Gemm")}
    sessions = {}
    for name in names:
        node = by_name.get(name)
        b = _constant(graph, node.input[1]) if node is not None else None
        if b is None or b.ndim != 2:
            continue
        b = np.ascontiguousarray(b, dtype=np.float32)
        weights = [numpy_helper.from_array(b, "b")]
        if node.op_type == "Gemm":
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            k = b.shape[1] if trans_b else b.shape[0]
            n_out = b.shape[0] if trans_b else b.shape[1]
            inputs = ["x", "b"]
            bias = _constant(graph, node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if bias is not None:
                weights.append(numpy_helper.from_array(bias, "c"))
                inputs.append("c")
            one = helper.make_node("Gemm", inputs, ["y"], transB=int(trans_b))
            x_shape, y_shape = [1, k], [1, n_out]
        else:
            one = helper.make_node("MatMul", ["x", "b"], ["y"])
            x_shape, y_shape = [1, 1, b.shape[0]], [1, 1, b.shape[1]]
        model = helper.make_model(
            helper.make_graph([one], "product", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], weights),
            opset_imports=[helper.make_opsetid("", 18)])
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.disable_prepacking", "1")  # as the runtime runs fp32 graphs
        session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
        session.run(None, {"x": x})  # first-run allocation
        sessions[name] = (session, x, b.nbytes)
    evict = np.ones(EVICT_BYTES // 8)
    times = {name: [] for name in sessions}
    for _ in range(runs):
        for name, (session, x, _) in sessions.items():
            float(evict.sum())
            t0 = time.perf_counter()
            session.run(None, {"x": x})
            times[name].append(time.perf_counter() - t0)
    return {name: {"ms": 1e3 * float(np.median(times[name])), "b_bytes": sessions[name][2]} for name in sessions}
