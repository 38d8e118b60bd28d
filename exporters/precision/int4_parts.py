"""int4 softmax parts: the adaptive softmax's head and tail graphs of an fp32 export, quantized as the model is.

An fp32 export of a model with an adaptive softmax has its body + head and each tail as graphs of their own beside
it (`contract.parts`), so a generator computes only the tails its sampling decision needs. An int4 graph derived
from it gets int4 parts: each part file is folded and quantized by `quantize_int4` with the model's block size and
accuracy_level, so a weight product has the same 4-bit blocks in the part as in the model (MatMulNBits' blocks run
along each output column's input dimension; concatenating columns changes none of them), then the parts are
checked against the int4 model they were made for before its metadata lists them (tolerances: see ATOL below).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx

from txl_deploy.contract import parts as contract
from txl_deploy.contract.onnx_file import external_data
from txl_deploy.errors import ExportError
from txl_deploy.exporters.graph_checks import toposort
from txl_deploy.exporters.onnx.writing import save_checked
from txl_deploy.exporters.precision.folding import fold_weight_subgraphs
from txl_deploy.exporters.precision.int4 import check_int4_graph, quantize_int4
from txl_deploy.runtimes.lazy_decode import full_log_probs

logger = logging.getLogger(__name__)

# The parts against the int4 graph: the same 4-bit weights and scales in every product and every embedding row (the
# head graph holds the tail clusters' tables without their output weights and quantizes them on their own, as the
# output layer's columns are, scales rounded to fp16 as the model's are: `int4._quantize_gathers`), so what remains
# is float rounding from the parts' other arrangement of the softmax. Before the scales were rounded alike, the
# tables differed by up to 2.8e-5, which the prepacked kernels' int8 activations turned into log-prob differences
# of 0.06 on the tiny test model. A wrong part (another cluster's weights, a head column out of place) differs by
# whole units.
ATOL, RTOL = 1e-3, 1e-4  # log-probs
STATE_ATOL = 1e-2  # memory


def quantize_parts_int4(fp32_path, info, model_path, block_size: int, accuracy_level: int) -> dict | None:
    """Write int4 copies of the softmax parts the fp32 graph at `fp32_path` lists (its metadata `info`) beside
    `model_path`, under the names `contract.parts` gives for it; returns their `export.parts` entry (precision
    "int4", not yet checked: see `check_parts_int4`), or None when the fp32 graph has no parts."""
    parts = contract.Parts.from_export(info.export, info.config, fp32_path)
    if parts is None:
        return None
    model_path = Path(model_path)
    sources = parts.files(fp32_path)  # present, in the fp32 graph's folder, the digests it lists
    targets = [model_path.with_name(contract.head_name(model_path))] + [
        model_path.with_name(contract.tail_name(model_path, i)) for i in range(1, parts.layout.n_clusters + 1)]
    for i, (src, dst) in enumerate(zip(sources, targets)):
        what = "the head graph" if i == 0 else f"the tail {i} graph"
        external_data(src)  # a part over protobuf's limit reads its data file: only one in its folder
        part = onnx.load(str(src))
        fold_weight_subgraphs(part)
        quantize_int4(part, block_size, accuracy_level)
        check_int4_graph(part)
        toposort(part.graph)
        save_checked(part, dst, f"the int4 {what}")  # as every exported file is written and checked
        del part
    logger.info(f"int4: the adaptive softmax's head and {parts.layout.n_clusters} tail graph(s) quantized "
                f"(block {block_size}, accuracy_level {accuracy_level})")
    return {"head": {"file": targets[0].name, "sha256": contract.sha256(targets[0])},
            "tails": [{"file": t.name, "sha256": contract.sha256(t)} for t in targets[1:]], "precision": "int4"}


def check_parts_int4(rt, seed: int = 0) -> dict:
    """The parts `rt` (a TxlRuntime over the int4 model, its parts open) computes from, against its model on a
    stream that fills and wraps the memory: the head's memory and the model's, and head + every tail assembled and
    the model's log-probs, agree within the tolerances above. Raises ExportError on a mismatch."""
    backend = rt.backend
    if backend.clusters is None:
        raise ExportError(f"the int4 softmax parts were not opened ({backend.parts_error})")
    clusters, rng = backend.clusters, np.random.default_rng(seed)
    full, lazy = backend.new_state(1), backend.new_state(1)
    lengths = [min(5, backend.max_segment), 1, 1, min(backend.mem_len + 3, backend.max_segment), 1]
    worst = 0.0
    for q in lengths:
        tokens = rng.integers(0, clusters.n_token, size=(1, q))
        positions = np.arange(q, dtype=np.int64)[None]
        want = backend.run(full, tokens, positions)
        hidden, head = backend.run_head(lazy, tokens, positions)
        flat_hidden, flat_head = hidden.reshape(-1, hidden.shape[-1]), head.reshape(-1, head.shape[-1])
        got = full_log_probs(backend, flat_hidden, flat_head).reshape(want.shape)  # the lazy path's composition
        diff = np.abs(got - want)
        worst = max(worst, float(diff.max()))
        if (diff > ATOL + RTOL * np.abs(want)).any():
            raise ExportError(f"the int4 softmax parts differ from the int4 graph: max abs difference "
                              f"{diff.max():.3g} outside |diff| <= {ATOL:g} + {RTOL:g} x |log-prob|; nothing was "
                              "written")
        a, b = backend.state_arrays(full), backend.state_arrays(lazy)
        if any(not np.allclose(a[k], b[k], atol=STATE_ATOL, rtol=0) for k in a):
            raise ExportError("the int4 head graph's memory differs from the int4 graph's; nothing was written")
    logger.info(f"  int4 parts checked against the int4 graph: max abs difference {worst:.3g} over "
                f"{len(lengths)} segments")
    return {"passed": True, "max_abs_diff": worst, "segments": len(lengths),
            "criterion": f"|diff| <= {ATOL:g} + {RTOL:g} x |log-prob| against the int4 graph",
            "state_outputs": f"|diff| <= {STATE_ATOL:g}"}
