"""The adaptive softmax's head and tails exported as graphs of their own, beside the model (contract: `contract.parts`).

ONNX Runtime runs every node of a graph whatever outputs a caller asks for, so a decoder that needs the head and
one tail of a word model still pays for every tail (62% of a WikiText-103 base decode step's bytes) unless the
parts are separate graphs. Each part is self-contained (its weights inline) and passes the checks the main graph
passes; `write_parts` checks them against the PyTorch cached step on a multi-segment stream before the model's
metadata lists them.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np

from txl_deploy.contract import parts as contract
from txl_deploy.contract.clusters import Clusters
from txl_deploy.contract.onnx_file import write_inline
from txl_deploy.contract.ring import write_ring
from txl_deploy.errors import ExportError
from txl_deploy.exporters.graph_checks import check_strict
from txl_deploy.exporters.onnx.trace import onnx_program, step_example
from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat
from txl_deploy.files import atomic_path, check_writable

logger = logging.getLogger(__name__)

# The parts compute what the main graph computes in another arrangement (the head's log-softmax, then each tail's
# log-softmax plus the head column): in fp32 the assembled log-probs stay within the main export's tolerance.
ATOL, RTOL = 1e-4, 1e-5


def _modules(cached):
    """(body + head module, [tail module of cluster i for i = 1..n]) over the tensors of `cached.output_layer`
    (`OutputLayer.head` and `OutputLayer.tail`'s formulas), sharing them: no copy of an output weight is made.
    The body + head module is `cached` itself with its last module replaced (write_parts puts it back)."""
    import torch.nn.functional as F  # optional (the torch extra): only code that runs a PyTorch model gets here
    from torch import nn  # optional (the torch extra), as above

    from txl_deploy.model.output_layer import logit  # imports torch

    layer = cached.output_layer

    class ClusterTensors(nn.Module):
        """Registers cluster i's weight, bias and projection of the output layer as its own buffers: the same
        tensor objects, so a traced part holds its own cluster's tensors and nothing else of the output layer
        (with div_val 1 the clusters are separate tensors already; nothing is sliced)."""

        def __init__(self, i):
            super().__init__()
            weight, bias, proj = layer.cluster_tensors(i)
            self.register_buffer("weight", weight, persistent=False)
            self.register_buffer("bias", bias, persistent=False)
            self.register_buffer("proj", proj, persistent=False)  # None registers nothing to trace

        def logit(self, hidden):
            return logit(hidden, self.weight, self.bias, self.proj)

    class HiddenAndHead(ClusterTensors):
        """Stands in for CachedTxl's output layer: returns the hidden states and the head's log-probs, so the
        cached step's body is traced unchanged and its outputs become (hidden, head_log_probs, *state)."""

        def __init__(self):
            super().__init__(0)

        def forward(self, hidden):
            return hidden, F.log_softmax(self.logit(hidden), dim=-1)

    class Tail(ClusterTensors):
        def forward(self, hidden, head_log_prob):
            return F.log_softmax(self.logit(hidden), dim=-1) + head_log_prob[:, None]

    cached.crit = HiddenAndHead()
    return cached, [Tail(i).eval() for i in range(1, cached.cfg.n_clusters + 1)]


def head_output_names(spec) -> list[str]:
    return [contract.HIDDEN, contract.HEAD_LOG_PROBS] + [s.name for s in spec.state_outputs()]


def _export(module, args, input_names, output_names, dynamic, opset):
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    try:
        with torch.no_grad():
            return onnx_program(module, args, input_names, output_names, dynamic, opset)
    except Exception as e:
        raise ExportError(f"torch.onnx.export of a softmax part failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from e


def _save(program, path: Path, force: bool, what: str) -> None:
    """Write a part: its weights inline (one file, as the main graph under 2 GB), checked as the main graph is."""
    with atomic_path(path, force=force) as tmp:
        program.save(str(tmp), external_data=True)
        del program  # the caller's reference is the last one: its tensors can go once the file has them
        # Both checks read the graph while its weights are still in the data file: onnx.checker on a one-file
        # model parses the weights, and full_check copies them again (three times the head's weights, which
        # hold the tied embedding). The inlined file holds the same protobuf, the data moved into it.
        check_tensorrt_compat(str(tmp)).raise_if_failed()
        check_strict(tmp, what)
        one = tmp.with_name(tmp.name + ".inline")
        write_inline(tmp, one)
        os.replace(one, tmp)
        Path(str(tmp) + ".data").unlink()


def write_parts(model, cached, out_path, *, opset: int, force: bool, verify: bool = True,
                threads: int | None = None) -> dict:
    """Export the head and every tail of `model`'s adaptive softmax beside `out_path` (`contract.parts` names),
    verify them against PyTorch and return the `export.parts` entry (file names and sha256) for the model's
    metadata.

    `cached` is the main graph's `CachedTxl` of `model` (the same mem_len, state and segments): the parts are
    traced from its body and its output layer's tensors, so the export holds no second copy of the weights."""
    cfg = model.cfg
    if cfg.n_clusters <= 0:
        raise ExportError("the model has no adaptive softmax clusters: there are no parts to export")
    out_path = Path(out_path)
    head_module, tails = _modules(cached)
    try:
        return _write_parts(model, head_module, tails, out_path, opset=opset, force=force, verify=verify,
                            threads=threads)
    finally:
        cached.crit = cached.output_layer


def _write_parts(model, head_module, tails, out_path: Path, *, opset, force, verify, threads) -> dict:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    cfg, spec = model.cfg, head_module.spec
    p = next(model.parameters())

    # The head: the main graph's inputs and dynamic axes.
    args, dynamic = step_example(head_module, p.dtype, batch=2, segment=3, positions=2)
    head_path = out_path.with_name(contract.head_name(out_path))
    logger.info(f"exporting the adaptive softmax's head and {cfg.n_clusters} tails as graphs of their own")
    # Each program is handed to _save without a name here, so that it is freed as soon as its file is written.
    _save(_export(head_module, args, spec.input_names(), head_output_names(spec), dynamic, opset), head_path,
          force, "the body + head graph")

    n = torch.export.Dim("rows", min=1, max=1 << 24)
    tail_paths = []
    for i, tail in enumerate(tails, start=1):
        path = out_path.with_name(contract.tail_name(out_path, i))
        example = (torch.zeros(2, cfg.d_model, dtype=p.dtype), torch.zeros(2, dtype=p.dtype))
        _save(_export(tail, example, [contract.HIDDEN, contract.HEAD_LOG_PROB], [contract.TAIL_LOG_PROBS],
                      ({0: n}, {0: n}), opset), path, force, f"the tail {i} graph")
        tail_paths.append(path)

    entry = {"head": {"file": head_path.name, "sha256": contract.sha256(head_path)},
             "tails": [{"file": t.name, "sha256": contract.sha256(t)} for t in tail_paths]}
    entry["precision"] = "fp32"  # a reduced-precision graph derived from this one must not run these parts
    if verify:
        try:
            report = verify_parts(model, head_module, head_path, tail_paths, threads=threads)
        except BaseException:
            for path in (head_path, *tail_paths):
                path.unlink(missing_ok=True)
            raise
        logger.info(f"  parts checked against PyTorch: max abs difference {report['max_abs_diff']:.3g} "
                    f"(|diff| <= {ATOL:g} + {RTOL:g} x |log-prob|, {report['segments']} segments)")
        entry["verification"] = report
    return entry


def move_parts(tmp, out_path, force: bool) -> None:
    """Move the parts written beside `tmp` (named after it) beside `out_path`, named after it."""
    tmp, out_path = Path(tmp), Path(out_path)
    names = [contract.head_name(tmp)] + [n.name for n in sorted(tmp.parent.glob(f"{tmp.stem}.tail*.onnx"))]
    for name in names:
        dest = out_path.with_name(out_path.stem + name[len(tmp.stem):])
        os.replace(tmp.parent / name, check_writable(dest, force))


def run_tails(sessions, hidden: np.ndarray, head: np.ndarray, layout: Clusters) -> list[np.ndarray]:
    """Every tail session on `hidden` [..., d_model] with its head column: [..., hi - lo] each."""
    return [run_tail(sess, i, hidden, head, layout) for i, sess in enumerate(sessions, start=1)]


def run_tail(session, i: int, hidden: np.ndarray, head: np.ndarray, layout: Clusters) -> np.ndarray:
    """Tail cluster i's session on `hidden` [..., d_model] with its head column: [..., hi - lo]."""
    lead = hidden.shape[:-1]
    flat, flat_head = hidden.reshape(-1, hidden.shape[-1]), head.reshape(-1, head.shape[-1])
    col = np.ascontiguousarray(flat_head[:, layout.head_column(i)])
    (lp,) = session.run(None, {contract.HIDDEN: flat, contract.HEAD_LOG_PROB: col})
    return lp.reshape(*lead, lp.shape[-1])


def verify_parts(model, cached, head_path, tail_paths, threads: int | None = None, batch: int = 2,
                 seed: int = 0) -> dict:
    """Run the parts with ONNX Runtime beside the PyTorch cached step over a stream of segments that fills and
    wraps the memory (prefill, decode steps, a segment longer than the memory where the graph allows) and refuse
    a mismatch of the assembled log-probs or of the state outputs.

    One part's session is open at a time: the head over the whole stream first (keeping its hidden states and head
    log-probs, and PyTorch's log-probs), then each tail on those. Every session of a word model at once, beside the
    PyTorch model, set the verified export's peak (the head graph holds the tied embedding, so all the output
    weights, and the tails hold them again). The comparison is the same: each piece of the assembled distribution
    against PyTorch's, element by element."""
    import onnxruntime as ort  # optional (the cpu extra)
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # A few calls each: MatMul's prepacked copies of the weights would cost memory and save no time.
    opts.add_session_config_entry("session.disable_prepacking", "1")
    if threads:
        opts.intra_op_num_threads = int(threads)
    cfg, spec, M = model.cfg, cached.spec, cached.mem_len
    layout = Clusters.of(cfg)
    gen = torch.Generator().manual_seed(seed)
    lengths = [min(5, cached.max_segment), 1, 1, min(M + 3, cached.max_segment), 1]
    state = cached.empty_state(batch, dtype=next(model.parameters()).dtype)
    worst = 0.0
    names = spec.input_names()
    streamed = []  # per segment: (hidden [B, P, d_model], head log-probs, PyTorch's log-probs [B, P, V])

    def check(got, want):
        nonlocal worst
        diff = np.abs(got - want)
        worst = max(worst, float(diff.max()))
        if got.shape != want.shape or (diff > ATOL + RTOL * np.abs(want)).any():
            raise ExportError(f"the softmax parts differ from PyTorch: max abs difference {diff.max():.3g} "
                              f"outside |diff| <= {ATOL:g} + {RTOL:g} x |log-prob|; nothing was written")

    head = ort.InferenceSession(str(head_path), opts, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for q in lengths:
            tokens = torch.randint(0, cfg.n_token, (batch, q), generator=gen)
            positions = torch.arange(q).expand(batch, q).contiguous()
            (ref_hidden, _), *outs = cached(tokens, positions, *state)
            want = model.crit(ref_hidden).numpy()  # the full output layer on PyTorch's hidden states
            feeds = {k: v.numpy() for k, v in zip(names, [tokens, positions, *state])}
            hidden, head_lp, *parts_outs = head.run(None, feeds)
            check(head_lp[..., :layout.shortlist], want[..., :layout.shortlist])
            for name, a, b in zip(head_output_names(spec)[2:], parts_outs, outs):
                if not np.allclose(a, b.numpy(), atol=ATOL, rtol=RTOL):
                    raise ExportError(f"the head graph's {name} differs from PyTorch; nothing was written")
            streamed.append((hidden, head_lp, want))
            # Advance the reference state as a runtime does: the ring buffer takes this segment's entries.
            if spec.state == "incremental":
                nxt = []
                for i in range(spec.n_layer):
                    nxt += list(write_ring(state[2 * i], state[2 * i + 1], outs[2 * i], outs[2 * i + 1], state[-1],
                                           M, in_place=False))
                state = nxt + [state[-1] + q]
            else:
                state = list(outs)
    del head
    for i, (path, (lo, hi)) in enumerate(zip(tail_paths, layout.bounds), start=1):
        tail = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        for hidden, head_lp, want in streamed:
            got = run_tail(tail, i, hidden, head_lp, layout)
            check(got, want[..., lo:hi])
        del tail
    return {"passed": True, "max_abs_diff": worst, "segments": len(streamed),
            "criterion": f"|diff| <= {ATOL:g} + {RTOL:g} x |log-prob|", "state_outputs": "allclose",
            "io": {"head": {"outputs": head_output_names(spec)[:2]}, "tail": {"inputs": [contract.HIDDEN,
                                                                                           contract.HEAD_LOG_PROB]}}}
