"""HTTP serving load: `txl-deploy serve` (and `serve --triton`) against the same streams as the rows of one
`TxlRuntime` in-process, and a session's time to first token against re-sending its context. Method and figures:
docs/benchmarks.md ("Serving")."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from benchmarks import harness
from benchmarks import serving_load as load
from txl_deploy.errors import InputError, TxlError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.ports import free_port
from txl_deploy.serving.triton.local_server import TritonServer, find_tritonserver
from txl_deploy.serving.triton.repository import write_repository

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = 16
DEFAULT_TOKENS = 64
DEFAULT_PROMPT_LEN = 48
DEFAULT_THREADS = 1
DEFAULT_REPEAT = 3
DEFAULT_CONTEXT = 2000
DEFAULT_FOLLOW_UP = 16
DEFAULT_MEM_LEN = 512
TRITON_QUEUE_DELAY_US = 2000
TIMEOUT = 600.0


class ServeProcess:
    """`txl-deploy serve ARGS` in its own process on 127.0.0.1 at a free port; SIGTERM on close."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).with_name("txl-deploy")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "txl_deploy.cli"]
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([*cmd, "serve", *args, "--port", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, timeout: float = TIMEOUT) -> "ServeProcess":
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise TxlError(f"txl-deploy serve exited while starting: {self.log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TxlError(f"txl-deploy serve did not become ready in {timeout:g} s")

    def close(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


# -- the load ---------------------------------------------------------------------------------------------------
async def _one_stream(client: httpx.AsyncClient, body: dict):
    """(sent, token times, token ids) of one streamed completion."""
    t0 = time.perf_counter()
    stamps, ids = [], []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise TxlError(f"the server answered {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise TxlError(f"the server failed a stream: {event['error']['message']}")
            got = event["choices"][0].get("token_ids") or []
            now = time.perf_counter()
            stamps += [now] * len(got)
            ids += got
    return t0, stamps, ids


def http_round(url: str, prompts, n_tokens: int):
    """C = len(prompts) concurrent greedy streams through a serve process."""
    async def run():
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
            bodies = [{"prompt": [int(t) for t in p], "max_tokens": n_tokens, "temperature": 0, "stream": True,
                       "return_token_ids": True} for p in prompts]
            return await asyncio.gather(*(_one_stream(client, b) for b in bodies))
    return asyncio.run(run())


def session_round(url: str, context, follow_up) -> dict:
    """TTFT of a follow-up continuing a session that holds `context`, and of re-sending context + follow-up."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
            r = await client.post("/v1/sessions")
            if r.status_code != 201:
                raise TxlError(f"could not create a session: {r.text[:300]}")
            sid = r.json()["id"]
            r = await client.post("/v1/completions", json={"prompt": [int(t) for t in context], "max_tokens": 0,
                                                           "session_id": sid})
            if r.status_code != 200:
                raise TxlError(f"could not give the session its context: {r.text[:300]}")
            body = {"prompt": [int(t) for t in follow_up], "max_tokens": 1, "temperature": 0, "stream": True,
                    "return_token_ids": True}
            t0, stamps, continued = await _one_stream(client, {**body, "session_id": sid})
            session_ttft = stamps[0] - t0
            full = {**body, "prompt": [int(t) for t in list(context) + list(follow_up)]}
            t0, stamps, resent = await _one_stream(client, full)
            await client.delete(f"/v1/sessions/{sid}")
            return {"session_ttft_s": session_ttft, "resend_ttft_s": stamps[0] - t0, "same_token": continued == resent}
    return asyncio.run(run())


# -- the whole benchmark --------------------------------------------------------------------------------------------
def run_benchmark(model=None, concurrency: int = DEFAULT_CONCURRENCY, tokens: int = DEFAULT_TOKENS,
                  prompt_len: int = DEFAULT_PROMPT_LEN, threads: int = DEFAULT_THREADS, repeat: int = DEFAULT_REPEAT,
                  context: int = DEFAULT_CONTEXT, follow_up: int = DEFAULT_FOLLOW_UP, triton: bool = True,
                  mem_len: int = DEFAULT_MEM_LEN, cache_dir=None, workdir=None) -> dict:
    """Every path's rounds, interleaved; the session continuation rounds; everything as a dict."""
    if tokens < 2 or concurrency < 1 or repeat < 1 or threads < 1 or context < 1 or follow_up < 1:
        raise InputError("--tokens must be at least 2; --concurrency, --repeat, --threads, --context and "
                         "--follow-up positive")
    if triton:
        find_tritonserver()  # fail before the export if there is no server
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": load.machine(),
              "concurrency": concurrency, "tokens": tokens, "prompt_len": prompt_len, "threads": threads,
              "repeat": repeat, "context": context, "follow_up": follow_up}
    with tempfile.TemporaryDirectory(prefix="txl-serve-load-") as tmp, ExitStack() as stack:
        tmp = Path(workdir or tmp)
        model_file, label = load.prepare_model(model, tmp, mem_len=mem_len, cache_dir=cache_dir)
        rt = TxlRuntime.load(model_file, providers=["cpu"], threads=threads)
        stack.callback(rt.close)
        result["model"] = load.model_fields(label, model_file, rt)
        prompts, result["prompt_kind"] = load.make_prompts(rt.vocab, rt.n_token, concurrency, prompt_len)
        rng = np.random.default_rng(1)
        long_text = rng.integers(0, rt.n_token, size=context + follow_up, dtype=np.int64)
        limits = ["--max-batch", str(concurrency), "--max-queue", str(4 * concurrency),
                  "--max-prompt-tokens", str(max(8192, context + follow_up))]
        servers = {"serve": ServeProcess([str(model_file), "--threads", str(threads), *limits],
                                         tmp / "serve.log")}
        stack.callback(servers["serve"].close)
        if triton:
            repo = write_repository(model_file, tmp / "repo", backend="python", max_batch=concurrency,
                                    max_sequences=4 * concurrency, max_queue_delay_us=TRITON_QUEUE_DELAY_US,
                                    threads=threads)
            tritonserver = stack.enter_context(TritonServer(repo))
            servers["serve --triton"] = ServeProcess(["--triton", tritonserver.grpc_url, *limits],
                                                     tmp / "serve-triton.log")
            stack.callback(servers["serve --triton"].close)
        for srv in servers.values():
            srv.wait_ready()
            http_round(srv.url, prompts[:2], 4)  # warm-up
        load.batched_round(rt, prompts[:2], 4)
        raw = {name: [] for name in [*servers, "in-process, batched"]}
        sessions = {name: [] for name in servers}
        paths = [(name, lambda url=srv.url: http_round(url, prompts, tokens)) for name, srv in servers.items()]
        paths.append(("in-process, batched", lambda: load.batched_round(rt, prompts, tokens)))
        for r in range(repeat):
            for name, fn in (paths if r % 2 == 0 else paths[::-1]):
                raw[name].append(fn())
                logger.info(load.round_line(name, r, raw[name][-1], tokens))
            for name, srv in servers.items():
                sessions[name].append(session_round(srv.url, long_text[:context], long_text[context:]))
                s = sessions[name][-1]
                logger.info(f"  round {r + 1}  {name:>20}  session TTFT {1e3 * s['session_ttft_s']:8.1f} ms, "
                            f"re-sent {1e3 * s['resend_ttft_s']:8.1f} ms")
        for srv in servers.values():
            for line in srv.log_path.read_text().splitlines():
                if "memory per session" in line:
                    result["memory_per_session_log"] = line.strip()
    result["paths"] = {name: load.summarise(raw[name], tokens, raw["in-process, batched"] if name in servers else None)
                       for name in raw}
    want = result["paths"]["in-process, batched"]["tokens"]
    result["tokens_match"] = {name: all(rnd_tokens == want for rnd_tokens in [[r[2] for r in rnd]
                                                                                for rnd in raw[name]])
                              for name in servers}
    result["sessions"] = {}
    for name, rounds in sessions.items():
        cont = np.array([s["session_ttft_s"] for s in rounds]) * 1e3
        full = np.array([s["resend_ttft_s"] for s in rounds]) * 1e3
        result["sessions"][name] = {"session_ttft_ms": cont.tolist(), "resend_ttft_ms": full.tolist(),
                                    "speedup": float(np.median(full) / np.median(cont)),
                                    "same_token": all(s["same_token"] for s in rounds)}
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["versions"] = load.versions()
    return result


# -- the report -------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    m = result["model"]
    lines = [
        (f"Model: {load.model_sentence(m)}, max_segment {m['max_segment']}), {result['threads']} ONNX "
         f"Runtime thread(s) on every side. {result['concurrency']} concurrent streams, each a "
         f"{result['prompt_len']}-token prompt ({result['prompt_kind']}) and {result['tokens']} greedy tokens; "
         f"{result['repeat']} interleaved rounds per path (tokens/s: the median round, slowest and fastest in "
         "brackets; latencies pool every stream of every round)."),
        "",
    ]
    lines += harness.table(["path", "tokens/s", "of in-process batched", "TTFT p50 ms", "TTFT p99 ms",
                            "inter-token p50 ms", "p99 ms"],
                           [[name, *load.rate_cells(p), f"{p['first_token_p50_ms']:.1f}", f"{p['first_token_p99_ms']:.1f}",
                             f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.1f}"] for name, p in result["paths"].items()],
                           numeric_from=1)
    same = ", ".join(f"{name}: {'yes' if ok else 'NO'}" for name, ok in result["tokens_match"].items())
    lines += ["", f"Every stream's tokens equal the in-process tokens: {same}.", "",
              (f"Session continuation: a session holding {result['context']} tokens of context gets a "
               f"{result['follow_up']}-token follow-up; against one request re-sending all "
               f"{result['context'] + result['follow_up']} tokens (time to the first token, median of "
               f"{result['repeat']}, each round's pair measured back to back):"), "",
              *harness.table(["path", "continued session TTFT ms", "re-sent context TTFT ms", "speedup",
                              "same first token"],
                             [[name, f"{np.median(s['session_ttft_ms']):.1f}", f"{np.median(s['resend_ttft_ms']):.1f}",
                               f"**{s['speedup']:.0f}x**", "yes" if s["same_token"] else "no"]
                              for name, s in result["sessions"].items()], numeric_from=1)]
    if result.get("memory_per_session_log"):
        lines += ["", f"The server's log: `{result['memory_per_session_log']}`"]
    lines += ["", load.measured_line(result["date"], result["machine"], result["versions"])]
    return "\n".join(lines) + "\n"


TARGETS = {"enwik8-base": 0.85, None: 0.50}  # serve's share of in-process batched tokens/s; None: the demo model


def results_file(results: list[dict], command: str) -> str:
    mach = results[0]["machine"]
    lines = [(f"Machine: {mach['cpus']} CPU cores ({mach['cpu']}), shared with other work: load average "
              f"{mach['load_average_start'][0]:.1f} at the start. Absolute speeds are noisy on a shared machine; "
              "the ratios compare paths measured in alternating rounds of the same run with the same threads."), ""]
    for result in results:
        m = result["model"]
        serve = result["paths"]["serve"]
        target = TARGETS.get("enwik8-base" if m["label"].startswith("enwik8-base") else None)
        s = result["sessions"]["serve"]
        lo, hi = (100 * f(serve["ratio_to_batched_rounds"]) for f in (min, max))
        lines += [f"## {m['label']}", "",
                  (f"- Throughput at {result['concurrency']} streams: `serve` makes "
                   f"**{100 * serve['ratio_to_batched']:.0f}%** of in-process batched tokens/s (rounds "
                   f"{lo:.0f}-{hi:.0f}%; target {100 * target:.0f}%: "
                   f"{'met' if serve['ratio_to_batched'] >= target else 'missed'})."),
                  (f"- Session continuation with {result['context']} tokens of context: **{s['speedup']:.0f}x** "
                   f"faster to the first token than re-sending it (target 20x: "
                   f"{'met' if s['speedup'] >= 20 else 'missed'})."), "", markdown(result)]
    return harness.results_markdown("HTTP serving: txl-deploy serve vs in-process, sessions", "\n".join(lines), command)


def measure(args, command):
    results = [run_benchmark(model, args.concurrency, args.tokens, args.prompt_len, args.threads, args.repeat,
                             args.context, args.follow_up, triton=not args.no_triton, mem_len=args.mem_len,
                             cache_dir=args.cache_dir)
               for model in (args.model or [None])]
    return results_file(results, command), results, 0 if all(r["tokens_match"]["serve"] for r in results) else 1


def main(argv=None) -> int:
    p = harness.parser("serve_load", __doc__, md="results_serve.md", threads=DEFAULT_THREADS)
    p.add_argument("--model", action="append", help="an .onnx file, a checkpoint or a shape name, repeatable "
                   "(default: the bundled demo model)")
    p.add_argument("--mem-len", type=int, default=DEFAULT_MEM_LEN, help="memory length of a shape stand-in")
    p.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="concurrent streams per round")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens per stream")
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="prompt tokens per stream")
    p.add_argument("--context", type=int, default=DEFAULT_CONTEXT, help="tokens a session holds before its follow-up")
    p.add_argument("--follow-up", type=int, default=DEFAULT_FOLLOW_UP, help="tokens of the follow-up")
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="interleaved rounds per path")
    p.add_argument("--no-triton", action="store_true", help="leave out the serve --triton path")
    return harness.main("serve_load", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
