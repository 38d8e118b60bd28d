"""Peers side by side: decode latency of the same model in ONNX Runtime (txl-deploy), OpenVINO, HuggingFace
transformers' TransfoXL, PyTorch eager and torch.compile, in one run.

    python benchmarks/peers.py [--model enwik8-base --model wt103-base --model txl_deploy/assets/demo/kjv-char]
                               [--batch 1,8] [--gen-len 24] [--repeat 3] [--threads 1] [--peers ...]
                               [--md benchmarks/results_peers.md] [--force]

Each model at its own memory length (enwik8 base 2100, WikiText-103 base 640, the demo model 128; --mem-len
overrides, one value per --model), memory full, one thread per side, the sides alternating in every round
(`txl_deploy/bench/peers.py` says what each side runs). Needs the test extra (openvino, transformers) and torch.
Writes the results file (included in RESULTS.md by run_all.py) and its JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from txl_deploy.bench.peers import PEERS, faster_than_reference, results_file, run_peers
from txl_deploy.bench.report import command_line, int_list, write_text
from txl_deploy.errors import TxlError
from txl_deploy.files import check_writable

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_MODELS = ("enwik8-base", "wt103-base", "txl_deploy/assets/demo/kjv-char")
NAMES = {"txl_deploy/assets/demo/kjv-char": "kjv-char-demo"}




def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the library's progress messages
    p = argparse.ArgumentParser(prog="python benchmarks/peers.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="a published shape name (random weights) or a checkpoint, repeatable (default: "
                        f"{', '.join(DEFAULT_MODELS)})")
    p.add_argument("--mem-len", type=int_list, default=None,
                   help="memory lengths, one per --model (default: each model's own)")
    p.add_argument("--batch", type=int_list, default=[1, 8], help="batch sizes (default 1,8)")
    p.add_argument("--gen-len", type=int, default=24, help="decode steps timed per side and round (default 24)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per side first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="threads per side (default 1)")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma-separated (default all: {','.join(PEERS)}); onnxruntime and eager always run")
    p.add_argument("--cache-dir", default=str(HERE / ".cache"), help="exports are kept here (default benchmarks/.cache)")
    p.add_argument("--md", default=str(HERE / "results_peers.md"), help="the results file; its JSON goes beside it")
    p.add_argument("--force", action="store_true", help="overwrite the results file and its JSON")
    args = p.parse_args(argv)
    models = args.model or list(DEFAULT_MODELS)
    md = Path(args.md)
    try:
        if args.mem_len and len(args.mem_len) != len(models):
            raise TxlError(f"--mem-len has {len(args.mem_len)} values for {len(models)} models")
        for path in (md, md.with_suffix(".json")):  # refuse before the measuring
            check_writable(path, args.force)
        mem_lens = args.mem_len or [None] * len(models)
        reports = []
        for model, mem_len in zip(models, mem_lens):
            path = model if not (ROOT / model).exists() else str(ROOT / model)
            reports.append(run_peers(path, mem_len, args.batch, args.gen_len, args.repeat, args.warmup,
                                     args.threads or None, args.cache_dir, [s for s in args.peers.split(",") if s],
                                     name=NAMES.get(model)))
        command = command_line("benchmarks/peers.py", sys.argv[1:] if argv is None else argv)
        text = results_file(reports, command)
        write_text(md.with_suffix(".json"), json.dumps({"command": command, "reports": reports}, indent=1) + "\n",
                   args.force)
        write_text(md, text, args.force)
        print(text)
        for name, batch, label, x in faster_than_reference(reports):
            print(f"FASTER than ONNX Runtime: {name} batch {batch}: {label} {x:.2f}x")
    except TxlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
