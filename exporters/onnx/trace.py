"""What the model's graph and its softmax parts are traced with: the step's example inputs and dynamic axes, and a
quiet `torch.onnx.export`, and what its rewriter keeps of a traced graph once the file is written. Torch is imported
inside each function (the torch extra): only an export gets here."""

from __future__ import annotations

import gc
import logging
import warnings


def step_example(module, dtype, *, batch: int, segment: int, positions: int):
    """(example inputs, dynamic shapes) of a cached step `module` (CachedTxl, or the parts' body + head): tokens
    [batch, segment], out_positions [batch, positions], an empty state, with the batch, segment, positions and
    (incremental graphs) memory-slot axes dynamic."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    spec = module.spec
    state = module.empty_state(batch, dtype=dtype)
    args = (torch.zeros(batch, segment, dtype=torch.long), torch.zeros(batch, positions, dtype=torch.long), *state)
    # torch.export specialises any dimension whose example size is 0 or 1, so every example size is >= 2.
    b = torch.export.Dim("batch", min=1, max=65536)
    q = torch.export.Dim("segment", min=1, max=65536)
    pos = torch.export.Dim("positions", min=1, max=65536)
    state_dims = [{0: b} for _ in state]
    if spec.state == "incremental" and spec.mem_len >= 2:
        # The slot axis of an incremental graph is dynamic too: the runtimes feed a 1-slot memory to a prompt
        # into an empty memory (see CachedTxl.forward). Full-state graphs keep every state shape static.
        slots = torch.export.Dim("slots", min=1, max=spec.mem_len)
        for i in range(spec.n_layer):
            state_dims[2 * i][3] = slots  # mem_k.i [B, H, d_head, slots]
            state_dims[2 * i + 1][2] = slots  # mem_v.i [B, H, slots, d_head]
    return args, ({0: b, 1: q}, {0: b, 1: pos}, tuple(state_dims))


def onnx_program(module, args, input_names, output_names, dynamic, opset: int):
    """torch.onnx.export (dynamo) of `module`, with torch.onnx's registry warnings (torchvision ops absent, ...),
    which say nothing about this model, kept out of the log."""
    import torch  # optional (the torch extra): only code that runs a PyTorch model gets here

    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.onnx.export(module, args, input_names=input_names, output_names=output_names,
                                     dynamic_shapes=dynamic, opset_version=opset, dynamo=True, verbose=False,
                                     report=False)
    finally:
        quiet.setLevel(level)


def forget_matched_graphs() -> None:
    """Drop the graph and the match each of onnxscript's module-level pattern matchers keeps from its last match.

    They hold numpy views of the weights that were folded (the Linear weights' Transposes), which pin those
    tensors' storage, and with it a memory-mapped checkpoint file as a whole. The attributes are private; if
    onnxscript renames them, nothing is dropped and the export only needs more memory."""
    try:
        from onnxscript.rewriter._matcher import SimplePatternMatcher  # optional (the torch extra): the exporter's
    except ImportError:
        return
    for obj in gc.get_objects():
        try:
            matcher = isinstance(obj, SimplePatternMatcher)
        except ReferenceError:  # a weakref.proxy whose object is gone (torch.compile leaves some behind)
            continue
        if matcher:
            for name in ("_graph", "_current_node", "_tracer", "_match"):
                if name in obj.__dict__:
                    setattr(obj, name, None)
