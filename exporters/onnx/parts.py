"""The adaptive softmax's head and tails exported as graphs of their own, beside the model (contract: `contract.parts`).

ONNX Runtime runs every node of a graph whatever outputs a caller asks for, so a decoder that needs the head and
one tail of a word model still pays for every tail (62% of a WikiText-103 base decode step's bytes) unless the
parts are separate graphs. Each part is written as the main graph is (`writing.finish`: one file under protobuf's
2 GB limit, its weights in `<file name>.data` beside it above) and passes the checks the main graph passes.

An export runs in phases so that the model's weights are in memory about once at a time: `write_parts` traces the
parts from the main graph's cached step (no second copy of the model), `verify_parts` checks them through the
runtime that verifies the main graph (its sessions share one pool of weights) against the same PyTorch reference
stream, and `finish_parts` checks and settles the files last, once the PyTorch model is gone.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import numpy as np

from txl_deploy.contract import parts as contract
from txl_deploy.contract.clusters import Clusters
from txl_deploy.errors import ExportError
from txl_deploy.exporters.onnx.trace import forget_matched_graphs, onnx_program, step_example
from txl_deploy.exporters.onnx.verify import ReferenceStream, describe, judge
from txl_deploy.exporters.onnx.writing import finish, place_external_data
from txl_deploy.exporters.tensorrt.compat import check_tensorrt_compat
from txl_deploy.files import check_writable
from txl_deploy.heap import return_free_memory
from txl_deploy.runtimes.lazy_decode import full_log_probs

logger = logging.getLogger(__name__)


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


def _save(program, path: Path) -> None:
    """Write a part with its weights in `<file name>.data` (as the main graph is first written) and check that it
    fits TensorRT; `finish_parts` runs the strict checks and settles the file once the PyTorch model is gone."""
    program.save(str(path), external_data=True)
    del program  # the caller's reference is the last one: its tensors can go once the file has them
    forget_matched_graphs()  # the rewriter's matchers pin the folded weights of the last graph they matched
    gc.collect()
    return_free_memory()
    check_tensorrt_compat(str(path)).raise_if_failed()


def write_parts(model, cached, out_path, *, opset: int) -> list[Path]:
    """Export the head and every tail of `model`'s adaptive softmax beside `out_path` (`contract.parts` names), each
    with its weights in a data file beside it; returns their paths (head first). Neither verified (`verify_parts`)
    nor settled into their final form (`finish_parts`) yet.

    `cached` is the main graph's `CachedTxl` of `model` (the same mem_len, state and segments): the parts are
    traced from its body and its output layer's tensors, so the export holds no second copy of the weights."""
    cfg = model.cfg
    if cfg.n_clusters <= 0:
        raise ExportError("the model has no adaptive softmax clusters: there are no parts to export")
    out_path = Path(out_path)
    head_module, tails = _modules(cached)
    try:
        return _write_parts(model, head_module, tails, out_path, opset=opset)
    finally:
        cached.crit = cached.output_layer


def _write_parts(model, head_module, tails, out_path: Path, *, opset) -> list[Path]:
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    cfg, spec = model.cfg, head_module.spec
    p = next(model.parameters())

    # The head: the main graph's inputs and dynamic axes.
    args, dynamic = step_example(head_module, p.dtype, batch=2, segment=3, positions=2)
    paths = [out_path.with_name(contract.head_name(out_path))]
    logger.info(f"exporting the adaptive softmax's head and {cfg.n_clusters} tails as graphs of their own")
    # Each program is handed to _save without a name here, so that it is freed as soon as its file is written.
    _save(_export(head_module, args, spec.input_names(), head_output_names(spec), dynamic, opset), paths[0])

    n = torch.export.Dim("rows", min=1, max=1 << 24)
    for i, tail in enumerate(tails, start=1):
        paths.append(out_path.with_name(contract.tail_name(out_path, i)))
        example = (torch.zeros(2, cfg.d_model, dtype=p.dtype), torch.zeros(2, dtype=p.dtype))
        _save(_export(tail, example, [contract.HIDDEN, contract.HEAD_LOG_PROB], [contract.TAIL_LOG_PROBS],
                      ({0: n}, {0: n}), opset), paths[-1])
    return paths


def parts_entry(paths) -> dict:
    """The `export.parts` entry of the fp32 parts at `paths` (head first): file names and sha256 of the files as
    they are now."""
    return {"head": {"file": paths[0].name, "sha256": contract.sha256(paths[0])},
            "tails": [{"file": t.name, "sha256": contract.sha256(t)} for t in paths[1:]],
            "precision": "fp32"}  # a reduced-precision graph derived from this one must not run these parts


def finish_parts(paths) -> dict:
    """Check every part strictly and settle it (`writing.finish`: one file under protobuf's limit), one at a time;
    returns the `export.parts` file entries of the settled files."""
    for i, path in enumerate(paths):
        finish(path, "the body + head graph" if i == 0 else f"the tail {i} graph")
    return parts_entry(paths)


def move_parts(tmp, out_path, force: bool) -> None:
    """Move the parts written beside `tmp` (named after it) beside `out_path`, named after it."""
    tmp, out_path = Path(tmp), Path(out_path)
    names = [contract.head_name(tmp)] + [n.name for n in sorted(tmp.parent.glob(f"{tmp.stem}.tail*.onnx"))]
    for name in names:
        dest = out_path.with_name(out_path.stem + name[len(tmp.stem):])
        os.replace(tmp.parent / name, check_writable(dest, force))
        place_external_data(tmp.parent / name, dest, force)  # a part over protobuf's limit keeps its data file


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


class _Assembled:
    """The parts' log-probs for one segment, `(lo, hi) -> [B, hi - lo, V]` a block of positions at a time (as
    compare_steps asks for them): the head's outputs are kept for the segment, the tails run per block."""

    def __init__(self, backend, hidden, head, block: int):
        self.backend, self.hidden, self.head, self.block = backend, hidden, head, block

    def __call__(self, lo, hi):
        hidden, head = self.hidden[:, lo:hi], self.head[:, lo:hi]
        flat = full_log_probs(self.backend, hidden.reshape(-1, hidden.shape[-1]), head.reshape(-1, head.shape[-1]))
        return flat.reshape(*hidden.shape[:2], flat.shape[-1])


def verify_parts(runtime, reference: ReferenceStream) -> dict:
    """Feed the verification stream to the parts (the head graph with its memory threaded, then every tail, composed
    as the lazy decoder composes them) of `runtime` (a TxlRuntime of the exported model, whose sessions share one
    pool of weights) and compare the assembled log-probs with `reference`, the PyTorch stream the main graph is
    checked against, with the main graph's fp32 tolerance: the parts compute what the main graph computes in
    another arrangement. A wrong memory from the head graph shows in every later segment. Raises ExportError on a
    mismatch, or when the parts cannot be opened."""
    backend = runtime.backend
    if backend.clusters is None:
        raise ExportError(f"the softmax parts cannot be opened ({backend.parts_error}); nothing was written")
    states = []

    def step(seg):
        if not states:
            states.append(backend.new_state(seg.shape[0]))
        positions = np.ascontiguousarray(np.broadcast_to(np.arange(seg.shape[1]), seg.shape))
        hidden, head = backend.run_head(states[0], seg, positions)
        return _Assembled(backend, hidden, head, ReferenceStream.BLOCK)

    report = judge(reference.compare(step), "fp32")
    logger.info("  parts: " + describe(report))
    if not report["passed"]:
        raise ExportError(f"the softmax parts differ from PyTorch: max abs difference {report['max_abs_diff']:.3g} "
                          f"outside {report['criterion']}; nothing was written")
    return report
