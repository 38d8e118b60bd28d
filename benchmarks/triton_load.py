"""Serving load: tokens/s and per-token latency through tritonserver vs the same model in-process.

    python benchmarks/triton_load.py [--model PATH|SHAPE ...] [--concurrency 1,16] [--tokens N] [--threads T]
                                     [--instances 1,2] [--max-batch B] [--queue-delay-us US] [--repeat R]
                                     [--json out.json] [--md out.md] [--force]

Paths compared, each at every concurrency C (C conversations at once, each with its own prompt, N greedy tokens):
- Triton gRPC: a Python-backend repository for the model (`txl-deploy triton-repo --backend python`: the only
  backend the bundled tritonserver has; it runs each Triton batch as one batched TxlRuntime call), served by
  tritonserver on 127.0.0.1 (free ports, `txl_deploy.serving.triton.local_server.TritonServer`), one server per --instances
  value; C client threads, each streaming its conversation with `txl_deploy.serving.triton.client` (one request per token,
  the server keeps the memory).
- in-process: C threads, each with its own `TxlRuntime` (its own memory) over ONE loaded ONNX Runtime session --
  what one Triton model instance holds -- so the difference to the server is Triton (scheduling, the Python
  backend's IPC), gRPC and the client.
- in-process, batched: the C conversations as the rows of one `TxlRuntime`, one ONNX Runtime run per token for all:
  the yardstick for the server, which batches the same way. The ratio column is server / this, per round.
Both sides use the same ONNX Runtime thread count (--threads, default 1: on a small shared machine, ONNX Runtime's
default of one thread per core made batch-1 decode twice as slow as one thread).

Per-token latency is the time between two tokens a conversation receives (the first token, which includes the
prompt, is its own column); tokens/s is C x N / wall time of a round (first prompt sent -> last token received).
Rounds are interleaved (per repeat, per C: every server, then in-process; the order reverses every other round) so
the machine's other load hits every path alike. Every conversation's server tokens are compared with its
in-process tokens (exit status 1 if any differ).

Models: --model, repeatable: an .onnx file, a checkpoint (exported to ONNX first), or a published shape name such
as `enwik8-base` (a random-weight stand-in with --mem-len, default 512; speed depends on the shape, not on the
weights). Default: the enwik8-base shape with max_queue_delay 10000 us, then the bundled demo model
`txl_deploy/assets/demo/kjv-char/` (a random model of its shape if it is absent) with 4000 us: the configuration
the documentation quotes. With --model and no --queue-delay-us, triton-repo's default delay. Prompts are held-out lines for character models whose vocabulary covers them, else seeded random ids.
Traffic goes to 127.0.0.1 only, request counts are bounded (C x (N + prompt pieces + 1) per round), and the servers
are stopped at the end, also on errors and Ctrl-C. --md writes a results file: the command, the machine and the
date, then one table per model.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from txl_deploy.bench.report import command_line, int_list, refuse_existing, stop_on_sigterm, write_text
from txl_deploy.bench.triton_load import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_BATCH,
    DEFAULT_MODELS,
    DEFAULT_PROMPT_LEN,
    DEFAULT_REPEAT,
    DEFAULT_SHAPE_MEM_LEN,
    DEFAULT_THREADS,
    DEFAULT_TOKENS,
    results_file,
    run_benchmark,
)
from txl_deploy.serving.triton.repository import DEFAULT_QUEUE_DELAY_US


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    p = argparse.ArgumentParser(prog="python benchmarks/triton_load.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="an .onnx file, a checkpoint (exported first) or a published shape name such as enwik8-base "
                        "(random weights); repeat for several models, each measured in turn. Default: the bundled "
                        "demo model, else a random model of its shape")
    p.add_argument("--mem-len", type=int, default=DEFAULT_SHAPE_MEM_LEN,
                   help=f"memory length of a shape-name stand-in (default {DEFAULT_SHAPE_MEM_LEN})")
    p.add_argument("--cache-dir", default=None,
                   help="keep shape stand-ins and their ONNX exports here between runs (default: a temporary folder)")
    p.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"ONNX Runtime intra-op threads, in-process and per server instance alike (default "
                        f"{DEFAULT_THREADS}); 0: ONNX Runtime's default (one per core)")
    p.add_argument("--concurrency", type=int_list, default=list(DEFAULT_CONCURRENCY),
                   help="concurrent conversations per round, comma-separated (default "
                        f"{','.join(map(str, DEFAULT_CONCURRENCY))})")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"greedy tokens each conversation generates (default {DEFAULT_TOKENS})")
    p.add_argument("--instances", type=int_list, default=[1],
                   help="Triton model instances; a comma-separated list runs one server per value (default 1)")
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN,
                   help=f"prompt tokens per conversation (default {DEFAULT_PROMPT_LEN})")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help=f"the repository's max_batch_size (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--queue-delay-us", type=int_list, default=None,
                   help="the sequence batcher's max_queue_delay_microseconds: how long Triton may hold a request "
                        "to fill a batch; a comma-separated list gives one per --model (a step of a large model can "
                        "afford a longer wait for the batch to fill than a small one). Default: "
                        f"{','.join(str(d) for _, d in DEFAULT_MODELS)} for the default models, else "
                        f"{DEFAULT_QUEUE_DELAY_US} (what triton-repo writes)")
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT,
                   help=f"rounds per row, interleaved across paths (default {DEFAULT_REPEAT})")
    p.add_argument("--json", default=None, help="also write every number (and the tokens) to this JSON file")
    p.add_argument("--md", default=None, help="also write the Markdown table to this file, headed by the command "
                                              "that wrote it (benchmarks/results_triton.md is included in RESULTS.md)")
    p.add_argument("--force", action="store_true", help="overwrite existing --json / --md files")
    args = p.parse_args(argv)

    from txl_deploy.errors import TxlError

    # The servers run in their own sessions (a Ctrl-C in a terminal does not reach them): turn SIGTERM into
    # KeyboardInterrupt so `with TritonServer(...)` stops them, as it does on Ctrl-C.
    stop_on_sigterm()
    try:
        refuse_existing((args.json, args.md), args.force)
        models = args.model or [model for model, _ in DEFAULT_MODELS]
        delays = args.queue_delay_us or ([DEFAULT_QUEUE_DELAY_US] if args.model else [d for _, d in DEFAULT_MODELS])
        if len(delays) not in (1, len(models)):
            raise TxlError(f"--queue-delay-us has {len(delays)} values for {len(models)} models: give one, or one "
                           "per --model")
        delays = delays * len(models) if len(delays) == 1 else delays
        results = [run_benchmark(model, args.concurrency, args.tokens, args.instances, args.prompt_len,
                                 args.max_batch, delay, args.repeat, threads=args.threads or None,
                                 mem_len=args.mem_len, cache_dir=args.cache_dir)
                   for model, delay in zip(models, delays)]
        command = command_line("benchmarks/triton_load.py", sys.argv[1:] if argv is None else argv)
        text = results_file(results, command)
        print()
        print(text)
        if args.json:
            write_text(args.json, json.dumps(results if len(results) > 1 else results[0], indent=1) + "\n", args.force)
        if args.md:
            write_text(args.md, text, args.force)
    except TxlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the servers were stopped)", file=sys.stderr)
        return 130
    return 0 if all(r["tokens_match"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
