"""HTTP serving load: `txl-deploy serve` against the same model in-process, `serve --triton` beside it, and the
time to a continued session's first token against re-sending its context.

    python benchmarks/serve_load.py [--model PATH|SHAPE ...] [--concurrency 16] [--tokens N] [--threads T]
                                    [--context 2000] [--repeat R] [--no-triton] [--json out.json] [--md out.md]

What each path is and how it is measured: txl_deploy/bench/serve_load.py. --md writes a results file headed by
the command that wrote it (benchmarks/results_serve.md is included in RESULTS.md by run_all.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from txl_deploy.bench.report import command_line, refuse_existing, stop_on_sigterm, write_text
from txl_deploy.bench.serve_load import (
    DEFAULT_CONCURRENCY,
    DEFAULT_CONTEXT,
    DEFAULT_FOLLOW_UP,
    DEFAULT_MEM_LEN,
    DEFAULT_PROMPT_LEN,
    DEFAULT_REPEAT,
    DEFAULT_THREADS,
    DEFAULT_TOKENS,
    results_file,
    run_benchmark,
)
from txl_deploy.errors import TxlError


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    p = argparse.ArgumentParser(prog="python benchmarks/serve_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="an .onnx file, a checkpoint (exported first) or a published shape name such as enwik8-base "
                        "(random weights); repeat for several. Default: the bundled demo model")
    p.add_argument("--mem-len", type=int, default=DEFAULT_MEM_LEN, help="memory length of a shape-name stand-in")
    p.add_argument("--cache-dir", default=None, help="keep shape stand-ins and their exports here between runs")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"ONNX Runtime threads on every side: serve, the Triton instance, in-process "
                        f"(default {DEFAULT_THREADS})")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="concurrent streams per round")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens per stream")
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="prompt tokens per stream")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens a session holds before its follow-up")
    p.add_argument("--follow-up", type=int, default=DEFAULT_FOLLOW_UP, help="tokens of the follow-up")
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="interleaved rounds per path")
    p.add_argument("--no-triton", action="store_true", help="leave out the serve --triton path")
    p.add_argument("--json", default=None, help="also write every number to this JSON file")
    p.add_argument("--md", default=None, help="write the results file (headed by this command) here")
    p.add_argument("--force", action="store_true", help="overwrite existing --json / --md files")
    args = p.parse_args(argv)
    stop_on_sigterm()  # the servers are stopped on the way out, as on Ctrl-C
    try:
        refuse_existing((args.json, args.md), args.force)
        results = [run_benchmark(model, args.concurrency, args.tokens, args.prompt_len, args.threads, args.repeat,
                                 args.context, args.follow_up, triton=not args.no_triton, mem_len=args.mem_len,
                                 cache_dir=args.cache_dir)
                   for model in (args.model or [None])]
        text = results_file(results, command_line("benchmarks/serve_load.py", sys.argv[1:] if argv is None else argv))
        print()
        print(text)
        if args.json:
            write_text(args.json, json.dumps(results, indent=1) + "\n", args.force)
        if args.md:
            write_text(args.md, text, args.force)
    except TxlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the servers were stopped)", file=sys.stderr)
        return 130
    return 0 if all(r["tokens_match"]["serve"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
