"""What a decode step reads and how close it comes to reading it: bytes counted from the graph, steps against the
read and copy of those bytes round by round, ONNX Runtime's profile per node, big weight products run alone.
Method: docs/benchmarks.md ("Decode efficiency")."""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from benchmarks import harness
from txl_deploy.bench.bandwidth_floor import BandwidthProbe
from txl_deploy.bench.op_profile import node_events, trace_steps
from txl_deploy.contract.metadata import read_onnx_info

PROBE = "bandwidth probe"  # the probe's turn among the sides of `interleaved_efficiency`
ELEMENT_BYTES = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 10: 2, 11: 8}  # onnx TensorProto data types: FLOAT, UINT8, INT8, ...


def graph_step_bytes(path) -> dict:
    """Bytes one decode step (batch 1, memory full) reads, by kind, counted from the graph: weight products,
    positional tables, the memory; each constant as the kernel reads it (fp16 cast at load, folded Transposes)."""
    graph = onnx.load(str(path)).graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}

    def constant(name):
        """(dims, bytes per element as the kernel reads it) of a constant input, or None for an activation."""
        if name in inits:
            t = inits[name]
            return list(t.dims), ELEMENT_BYTES.get(t.data_type, 4)
        node = producer.get(name)
        if node is None or node.op_type not in ("Cast", "Transpose", "Reshape", "Squeeze", "Unsqueeze", "Slice",
                                                "Concat"):
            return None
        srcs = [constant(i) for i in node.input[:1 if node.op_type != "Concat" else None]]
        if any(c is None for c in srcs):
            return None
        dims, size = srcs[0]
        if node.op_type == "Cast":
            return dims, ELEMENT_BYTES.get(next(a.i for a in node.attribute if a.name == "to"), 4)
        if node.op_type == "Concat":  # the pieces of an adaptive-softmax head: their elements, in one block
            return [sum(int(np.prod(d)) for d, _ in srcs)], size
        if node.op_type == "Slice":  # the rows of a cluster, cut from the tied embedding
            starts, ends = (numpy_helper.to_array(inits[i]) for i in node.input[1:3])
            axes = numpy_helper.to_array(inits[node.input[3]]) if len(node.input) > 3 else range(len(starts))
            dims = list(dims)
            for axis, a, b in zip(axes, starts, ends):
                dims[axis] = max(0, min(int(b), dims[axis]) - min(int(a), dims[axis]))
        return dims, size

    out = {"weights": 0, "positional_tables": 0}
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            inputs = node.input[1:]
        elif node.op_type in ("MatMul", "Gemm"):
            inputs = node.input
        else:
            continue
        for name in inputs:
            c = constant(name) if name else None
            if c is not None:
                kind = "positional_tables" if node.op_type == "MatMul" and len(c[0]) == 3 else "weights"
                out[kind] += int(np.prod(c[0])) * c[1]
    info = read_onnx_info(path)
    cfg = info.config
    state_bytes = 2 if info.precision == "fp16" else 4
    out["memory"] = 2 * cfg.n_layer * cfg.n_head * cfg.d_head * info.mem_len * state_bytes
    out["total"] = out["weights"] + out["positional_tables"] + out["memory"]
    return out


def interleaved_efficiency(steps: dict, n_bytes: dict, probe: BandwidthProbe, rounds: int, steps_per_round: int) -> dict:
    """Each side's step ({side: callable}) against the read and copy of its bytes ({side: bytes}), round by round
    with the probe taking its turn, in wall and in CPU time (`efficiency`)."""
    def timed(step):
        def side(_):
            wall, cpu = [], []
            for _ in range(steps_per_round):
                t0, c0 = time.perf_counter(), time.thread_time()
                step()
                wall.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            return 1e3 * harness.median(wall), 1e3 * harness.median(cpu)
        return side

    out = harness.interleaved({**{s: timed(f) for s, f in steps.items()}, PROBE: lambda _: probe()}, rounds)
    bandwidths = out.pop(PROBE)
    return {s: efficiency(n_bytes[s], [w for w, _ in r], bandwidths, [c for _, c in r]) for s, r in out.items()}


def _over(n_bytes: int, step_ms, rates) -> float:
    """The median over rounds of each round's step over its bytes at that round's rate."""
    return harness.median([ms / (n_bytes / bw * 1e3) for ms, bw in zip(step_ms, rates)])


def efficiency(n_bytes: int, step_ms_rounds, bandwidths, step_cpu_ms_rounds=None) -> dict:
    """The step's median against `n_bytes` read and copied at each round's bandwidth: `read_ms`, `copy_ms`, and
    `over_read`, `over_copy`, medians of each round's own ratio (a round slowed by another job meets its own
    bandwidth); with `step_cpu_ms_rounds`, the same in CPU time (`*_cpu`: no time spent waiting for a core)."""
    step = [float(ms) for ms in step_ms_rounds]
    out = {"bytes": int(n_bytes), "step_ms": harness.median(step), "step_ms_rounds": step}
    for kind in ("read", "copy"):
        rates = [float(getattr(bw, kind)) for bw in bandwidths]
        out.update({f"{kind}_bytes_per_s": harness.median(rates), f"{kind}_ms": n_bytes / harness.median(rates) * 1e3,
                    f"over_{kind}": _over(n_bytes, step, rates)})
    if step_cpu_ms_rounds is None:
        return out
    cpu = [float(ms) for ms in step_cpu_ms_rounds]
    out.update(step_cpu_ms=harness.median(cpu), step_cpu_ms_rounds=cpu)
    if all(bw.read_cpu is not None and bw.copy_cpu is not None for bw in bandwidths):
        for kind in ("read", "copy"):
            rates = [getattr(bw, f"{kind}_cpu") for bw in bandwidths]
            out.update({f"{kind}_cpu_bytes_per_s": harness.median(rates),
                        f"{kind}_cpu_ms": n_bytes / harness.median(rates) * 1e3,
                        f"over_{kind}_cpu": _over(n_bytes, cpu, rates)})
    return out


EFFICIENCY_HEAD = ["MB read / step", "step ms", "plain read ms", "copy floor ms", "step / read", "step / copy",
                   "step CPU ms", "read CPU ms", "copy floor CPU ms", "step / read (CPU time)",
                   "step / copy (CPU time)"]


def efficiency_cells(r: dict) -> list[str]:
    """An `efficiency` result as the cells under EFFICIENCY_HEAD."""
    return [f"{r['bytes'] / 1e6:.1f}", f"{r['step_ms']:.2f}", f"{r['read_ms']:.2f}", f"{r['copy_ms']:.2f}",
            f"{r['over_read']:.2f}x", f"{r['over_copy']:.2f}x", f"{r['step_cpu_ms']:.2f}", f"{r['read_cpu_ms']:.2f}",
            f"{r['copy_cpu_ms']:.2f}", f"{r['over_read_cpu']:.2f}x", f"{r['over_copy_cpu']:.2f}x"]


# Bytes per element of the type names ONNX Runtime's profiler writes in a node's input_type_shape.
PROFILE_TYPE_BYTES = {"float": 4, "float16": 2, "double": 8, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}


def input_bytes(event, constants=None) -> int:
    """The bytes a profiled kernel reads: activations from its input_type_shape, constants from the graph
    (`constants`: {input position: bytes}; a prepacked weight is not always listed with its shape)."""
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
    """`profile_decode` per node: {"step_ms", "nodes": [{name, op_type, ms_per_step, bytes}] slowest first, "ops":
    [{op_type, ms_per_step, bytes, gb_per_s, nodes}]}, bytes being every input a node reads per step."""
    runs, events, cpu = trace_steps(onnx_path, state, tokens, threads, steps, providers)
    constants = constant_input_bytes(onnx_path)
    per_step = [defaultdict(float) for _ in runs]
    info = {}
    for k, e in node_events(runs, events):
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


def _constant(graph, name):
    """A MatMul's B when it is an initializer or an initializer's Transpose (a tied output layer), else None."""
    inits = {t.name: t for t in graph.initializer}
    if name in inits:
        return numpy_helper.to_array(inits[name])
    node = next((n for n in graph.node if name in n.output), None)
    if node is not None and node.op_type == "Transpose" and node.input[0] in inits:
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        return np.transpose(numpy_helper.to_array(inits[node.input[0]]), perm)
    return None


# Read between the runs of `matmul_alone` so that each finds its weight in memory, not in a cache, as in a decode
# step; larger than the last-level caches of the machines measured here (32 MB).
EVICT_BYTES = 128 * 2**20


def matmul_alone(onnx_path, names, threads: int = 1, runs: int = 30) -> dict:
    """Median ms of each named weight product run alone (a one-node model, same constant B, one token, after a read
    of EVICT_BYTES so that the weight comes from memory as in a step); a B that is not a constant is left out."""
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
        session = harness.ort_session(model.SerializeToString(), threads,  # no prepacking: as the runtime runs fp32
                                      config={"session.disable_prepacking": "1"})
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
