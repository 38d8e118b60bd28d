"""Chaos against `txl-deploy serve`: minutes of mixed load and client-side faults over loopback, then what must hold
once the server is idle again.

    python benchmarks/serve_chaos.py [--model PATH] [--duration 300] [--workers 8] [--seed 0] [--in-process]
                                     [--json out.json] [--md out.md] [--force]

What runs and what is checked: txl_deploy/bench/serve_chaos.py (the suite runs a one-minute version of the same
driver, tests/serving/http/test_serve_chaos.py). The server is a real `txl-deploy serve` of the model (by default
the bundled demo model, exported to ONNX) in its own process; its descriptors and resident memory are read from
/proc, its rows through the capacity probe; --in-process serves the app in this process instead, so that its rows
are also counted in the engine thread. --md writes a results file headed by the command that wrote it
(benchmarks/results_chaos.md is included in RESULTS.md by run_all.py). Exits 1 when a criterion failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from txl_deploy.bench.report import command_line, refuse_existing, results_markdown, stop_on_sigterm, write_text
from txl_deploy.bench.serve_chaos import ChaosSettings, Target, markdown, passed, run_chaos, runtime_reference, summary
from txl_deploy.bench.serve_load import ServeProcess
from txl_deploy.bench.triton_load import _machine, _versions, prepare_model
from txl_deploy.errors import TxlError
from txl_deploy.runtimes import TxlRuntime

MAX_PROMPT = 512


def serve_and_run(args, tmp: Path) -> tuple[dict, dict]:
    """The server up, the chaos against it, the server stopped; (report, what the results file says about it)."""
    model_file, label = prepare_model(args.model, tmp, cache_dir=args.cache_dir)
    key = secrets.token_hex(12)
    limits = {"max_batch": args.max_batch, "max_sessions": args.max_sessions, "max_queue": 4 * args.max_batch}
    settings = ChaosSettings(duration_s=args.duration, warmup_s=args.warmup, workers=args.workers, seed=args.seed,
                             golden=args.golden, timeout_s=args.timeout, hold_s=3.0)
    reference = runtime_reference(lambda: TxlRuntime.load(model_file, providers=["cpu"], threads=args.threads))
    about = {"label": label, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
             "machine": _machine(), "versions": _versions(None)}
    if args.in_process:
        # the serve extra (FastAPI, uvicorn) is needed for this path only
        from txl_deploy.serving.http.app import ServeSettings
        from txl_deploy.serving.http.scheduler import Scheduler
        from txl_deploy.serving.http.server import BackgroundServer

        load = functools.partial(Scheduler.load, model_file, providers=["cpu"], threads=args.threads, **limits)
        srv = BackgroundServer(load, ServeSettings(model_name="chaos", api_key=key, max_prompt_tokens=MAX_PROMPT))
        with srv:
            target = Target(srv.url, os.getpid(), args.max_batch, args.max_sessions, max_prompt_tokens=MAX_PROMPT,
                            api_key=key, engine=srv.engine)
            report = run_chaos(target, settings, reference)
        about["server"] = "the app in this process (uvicorn in a thread; rows counted in the engine thread)"
        return report, about
    srv = ServeProcess([str(model_file), "--threads", str(args.threads), "--max-batch", str(args.max_batch),
                        "--max-sessions", str(args.max_sessions), "--max-queue", str(limits["max_queue"]),
                        "--max-prompt-tokens", str(MAX_PROMPT), "--api-key", key], tmp / "serve.log")
    try:
        srv.wait_ready()
        target = Target(srv.url, srv.proc.pid, args.max_batch, args.max_sessions, max_prompt_tokens=MAX_PROMPT,
                        api_key=key)
        report = run_chaos(target, settings, reference)
    finally:
        if srv.proc.poll() is None:
            srv.proc.send_signal(signal.SIGTERM)
        try:
            about["exit"] = srv.proc.wait(60)
        except subprocess.TimeoutExpired:
            srv.close()
            about["exit"] = "none: still running 60 s after SIGTERM (killed)"
    log = srv.log_path.read_text(errors="replace").splitlines()
    about["log_errors"] = sum(("ERROR" in ln or "Traceback" in ln) for ln in log)
    about["server"] = f"`txl-deploy serve` in its own process ({args.threads} ONNX Runtime thread(s))"
    return report, about


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    p = argparse.ArgumentParser(prog="python benchmarks/serve_chaos.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="an .onnx file or a checkpoint (exported first); default: the "
                                                 "bundled demo model")
    p.add_argument("--cache-dir", default=None, help="keep exports of shape stand-ins here between runs")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of chaos after the warm-up")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of the same mix before the baselines")
    p.add_argument("--workers", type=int, default=8, help="operations at once")
    p.add_argument("--golden", type=int, default=3, help="golden conversations at once")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one operation may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="ONNX Runtime threads of the server and the reference")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-sessions", type=int, default=32)
    p.add_argument("--in-process", action="store_true", help="serve the app in this process (rows counted exactly)")
    p.add_argument("--json", default=None, help="also write the whole report to this JSON file")
    p.add_argument("--md", default=None, help="write the results file (headed by this command) here")
    p.add_argument("--force", action="store_true", help="overwrite existing --json / --md files")
    args = p.parse_args(argv)
    stop_on_sigterm()  # the server is stopped on the way out, as on Ctrl-C
    try:
        refuse_existing((args.json, args.md), args.force)
        if args.max_sessions < 2 * (args.workers + args.golden):
            raise TxlError("--max-sessions must be at least 2 x (--workers + --golden): the golden sessions must "
                           "never be the least recently used one evicted")
        with tempfile.TemporaryDirectory(prefix="txl-serve-chaos-") as tmp:
            report, about = serve_and_run(args, Path(tmp))
        command = command_line("benchmarks/serve_chaos.py", sys.argv[1:] if argv is None else argv)
        text = results_markdown("HTTP serving under chaos: faults from the clients, what holds after",
                                markdown(report, about), command)
        print()
        print(summary(report))
        if args.json:
            write_text(args.json, json.dumps({"report": report, "about": about, "command": command}, indent=1,
                                             default=str) + "\n", args.force)
        if args.md:
            write_text(args.md, text, args.force)
    except TxlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted (the server was stopped)", file=sys.stderr)
        return 130
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
