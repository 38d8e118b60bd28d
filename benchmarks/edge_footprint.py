"""Memory one stream needs on each edge target, per precision, computed from TxlConfig: the table of docs/edge.md
("Memory per target"), which says what is counted. Activations and the runtime's own buffers are not (measured
resident sizes: benchmarks/results_int4.md)."""

from __future__ import annotations

import argparse
import json

from txl_deploy.assets import DEMO_DIR
from txl_deploy.config import TxlConfig, published_config
from txl_deploy.contract.clusters import pieces

PRECISIONS = {  # name: (bytes per matrix weight (int4's: by block size), per other value, per state value, targets)
    "fp32": (4, 4, 4, "ARM64 CPU, Jetson (TensorRT), browser"),
    "fp16": (2, 2, 2, "Jetson (TensorRT), browser"),
    "int8": (1, 4, 4, "Jetson (TensorRT)"),
    "int8-dynamic": (1, 4, 4, "ARM64 CPU"),
    "int4": (None, 4, 4, "ARM64 CPU, browser"),
}


def parameter_counts(cfg, mem_len: int, max_segment: int) -> dict:
    """Element counts of the exported graph's constants: body and output-layer matrices, embedding, the rest."""
    D, H, Dh, Di, L = cfg.d_model, cfg.n_head, cfg.d_head, cfg.d_inner, cfg.n_layer
    longest = mem_len + max_segment  # positional table: distances the graph can see (cached.r_table_size)
    T = min(cfg.clamp_len + 1, longest) if cfg.clamp_len > 0 else longest
    body = L * (3 * D * H * Dh + H * Dh * D + 2 * D * Di)
    other = L * (Di + D + 4 * D + H * Dh * T) + 2 * H * Dh * (L if cfg.untie_r else 1)
    embedding = output = 0
    for i, (lo, hi) in enumerate(pieces(cfg.cutoffs, cfg.n_token)):
        d_i = cfg.d_embed // cfg.div_val**i if cfg.div_val > 1 else cfg.d_embed
        proj = D * d_i if d_i != D else 0
        embedding += (hi - lo) * d_i + proj
        output += (hi - lo) * d_i + (0 if cfg.tie_projs[i] else proj)
        other += hi - lo  # output bias
    output += cfg.n_clusters * cfg.d_embed  # the head's cluster logits
    other += cfg.n_clusters
    return {"body": body, "output": output, "embedding": embedding, "other": other, "tied": cfg.tie_weight}


def weight_bytes(counts: dict, precision: str, block_size: int) -> float:
    """How each precision stores the three kinds of matrices (see exporters/precision.py)."""
    per_weight, per_other, _, _ = PRECISIONS[precision]
    if precision in ("fp32", "fp16"):  # one table serves the lookup and, tied, the output layer
        matrices = (counts["body"] + counts["embedding"] + (0 if counts["tied"] else counts["output"])) * per_weight
    elif precision in ("int8", "int8-dynamic"):  # the output layer is quantized, the embedding lookup stays fp32
        matrices = (counts["body"] + counts["output"]) * per_weight + counts["embedding"] * 4
    else:  # int4: a tied lookup reads the output layer's 4-bit blocks
        per_weight = 0.5 + 4 / block_size + 0.5 / block_size  # its share of a block's fp32 scale and 4-bit zero
        matrices = (counts["body"] + counts["output"] + (0 if counts["tied"] else counts["embedding"])) * per_weight
    return matrices + counts["other"] * per_other


def table(shapes, max_segment: int, block_size: int) -> str:
    lines = ["| model | mem_len | precision | runs on | weights | memory per stream | one stream |",
             "|---|---|---|---|---|---|---|"]
    for label, cfg, mem_len in shapes:
        counts = parameter_counts(cfg, mem_len, max_segment)
        for name, (_, _, state, targets) in PRECISIONS.items():
            weights = weight_bytes(counts, name, block_size)
            memory = cfg.memory_bytes_per_stream(mem_len, state)["kv_cache"] + 8
            lines.append(f"| {label} | {mem_len} | {name} | {targets} | {_mb(weights)} | {_mb(memory)} | "
                         f"{_mb(weights + memory)} |")
    return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def main():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.edge_footprint", description=__doc__.splitlines()[0])
    ap.add_argument("--max-segment", type=int, default=512, help="the export's max_segment (default 512)")
    ap.add_argument("--block-size", type=int, default=32, help="int4 block size (default 32)")
    args = ap.parse_args()
    demo = TxlConfig.from_dict(json.loads((DEMO_DIR / "kjv-char" / "config.json").read_text())["config"])
    wt103 = published_config("wt103-base")
    print(table([("demo (kjv-char)", demo, demo.mem_len), ("WikiText-103 base", wt103, wt103.mem_len)],
                args.max_segment, args.block_size))


if __name__ == "__main__":
    main()
