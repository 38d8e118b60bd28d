"""The paper's Table 9 on the deployed runtime: Transformer-XL's evaluation against a vanilla Transformer's.

    python benchmarks/paper_table9.py [--lengths 800,1800,2800,3800] [--model enwik8-base] [--segment 80]
                                      [--rounds 3] [--threads 1] [--md benchmarks/results_table9.md] [--force]

Both sides in ONNX Runtime with the same intra-op thread count: Transformer-XL (the enwik8 base shape, random
weights, exported by txl-deploy with mem_len = L, run through TxlRuntime) and a vanilla Transformer of the same
size with absolute positions and no memory, which recomputes its whole window of L tokens for every predicted token
(`txl_deploy/bench/paper_table9.py` says exactly what each side computes). Writes the results file (included in
RESULTS.md by run_all.py), its JSON beside it, and a plot of the slowdown against L (matplotlib, the bench extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from txl_deploy.bench.paper_table9 import (
    DEFAULT_LENGTHS,
    DEFAULT_SEGMENT,
    DEFAULT_SHAPE,
    markdown,
    plot,
    run_table9,
)
from txl_deploy.bench.report import command_line, int_list, results_markdown, write_text
from txl_deploy.errors import TxlError
from txl_deploy.files import check_writable

HERE = Path(__file__).resolve().parent
TITLE = "The paper's Table 9: evaluation speed against a vanilla Transformer"




def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    p = argparse.ArgumentParser(prog="python benchmarks/paper_table9.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int_list, default=list(DEFAULT_LENGTHS),
                   help="attention lengths L, comma-separated (default: the paper's 800,1800,2800,3800)")
    p.add_argument("--model", default=DEFAULT_SHAPE,
                   help=f"a published shape name (random weights) or a checkpoint (default {DEFAULT_SHAPE})")
    p.add_argument("--segment", type=int, default=DEFAULT_SEGMENT,
                   help=f"Transformer-XL's evaluation segment in tokens (default {DEFAULT_SEGMENT}, enwik8 base's)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds per L: one vanilla window each (default 3)")
    p.add_argument("--decode-steps", type=int, default=16,
                   help="Transformer-XL one-token calls per round (default 16)")
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads of both sides (default 1)")
    p.add_argument("--cache-dir", default=str(HERE / ".cache"), help="exports are kept here (default benchmarks/.cache)")
    p.add_argument("--md", default=str(HERE / "results_table9.md"),
                   help="the results file; its JSON and plot (.png) are written beside it")
    p.add_argument("--force", action="store_true", help="overwrite the results file, its JSON and its plot")
    args = p.parse_args(argv)
    md = Path(args.md)
    try:
        for path in (md, md.with_suffix(".json"), md.with_suffix(".png")):  # refuse before the measuring
            check_writable(path, args.force)
        result = run_table9(args.lengths, model=args.model, segment=args.segment, rounds=args.rounds,
                            decode_steps=args.decode_steps, threads=args.threads or None, cache_dir=args.cache_dir)
        command = command_line("benchmarks/paper_table9.py", sys.argv[1:] if argv is None else argv)
        result["command"] = command
        body = markdown(result)
        try:
            plot(result, md.with_suffix(".png"), force=args.force)
            body += f"\n![vanilla time over Transformer-XL time per token against L]({md.with_suffix('.png').name})\n"
        except ImportError:
            print("no plot: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        write_text(md.with_suffix(".json"), json.dumps(result, indent=1) + "\n", args.force)
        text = results_markdown(TITLE, body, command)
        write_text(md, text, args.force)
        print(text)
    except TxlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
