"""HTTP serving load: `txl-deploy serve` (and `serve --triton`) against the same streams as the rows of one
`TxlRuntime` in-process, and a session's time to first token against re-sending its context. Method and figures:
docs/benchmarks.md ("Serving")."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time

import httpx
import numpy as np

from benchmarks import harness
from benchmarks import serving_load as load
from txl_deploy.errors import TxlError
from txl_deploy.serving.triton.local_server import TritonServer
from txl_deploy.serving.triton.repository import write_repository

logger = logging.getLogger(__name__)

TRITON_QUEUE_DELAY_US = 2000
BATCHED = "in-process, batched"
TARGETS = {"enwik8-base": 0.85, None: 0.50}  # serve's share of in-process batched tokens/s; None: the demo model


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
            stamps += [time.perf_counter()] * len(got)
            ids += got
    return t0, stamps, ids


def _greedy(prompt, n_tokens: int, **extra) -> dict:
    return {"prompt": [int(t) for t in prompt], "max_tokens": n_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, **extra}


def http_round(url: str, prompts, n_tokens: int):
    """C = len(prompts) concurrent greedy streams through a serve process."""
    async def run():
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
        async with httpx.AsyncClient(base_url=url, timeout=load.TIMEOUT, limits=limits) as client:
            return await asyncio.gather(*(_one_stream(client, _greedy(p, n_tokens)) for p in prompts))
    return asyncio.run(run())


def session_round(name: str, r: int, url: str, context, follow_up) -> dict:
    """TTFT of a follow-up continuing a session that holds `context`, and of re-sending context + follow-up."""
    async def run():
        async with httpx.AsyncClient(base_url=url, timeout=load.TIMEOUT) as client:
            r = await client.post("/v1/sessions")
            if r.status_code != 201:
                raise TxlError(f"could not create a session: {r.text[:300]}")
            sid = r.json()["id"]
            r = await client.post("/v1/completions", json={"prompt": [int(t) for t in context], "max_tokens": 0,
                                                           "session_id": sid})
            if r.status_code != 200:
                raise TxlError(f"could not give the session its context: {r.text[:300]}")
            t0, stamps, continued = await _one_stream(client, _greedy(follow_up, 1, session_id=sid))
            t1, stamps1, resent = await _one_stream(client, _greedy([*context, *follow_up], 1))
            await client.delete(f"/v1/sessions/{sid}")
            return {"session_ttft_s": stamps[0] - t0, "resend_ttft_s": stamps1[0] - t1, "same_token": continued == resent}
    s = asyncio.run(run())
    logger.info(f"  round {r + 1}  {name:>20}  session TTFT {1e3 * s['session_ttft_s']:8.1f} ms, "
                f"re-sent {1e3 * s['resend_ttft_s']:8.1f} ms")
    return s


# -- the whole benchmark --------------------------------------------------------------------------------------------
def run_benchmark(model=None, concurrency: int = 16, tokens: int = 64, prompt_len: int = 48, threads: int = 1,
                  repeat: int = 3, context: int = 2000, follow_up: int = 16, triton: bool = True,
                  mem_len: int = load.DEFAULT_SHAPE_MEM_LEN, cache_dir=None) -> dict:
    """Every path's rounds and the session continuation rounds, interleaved; everything as a dict."""
    load.check_settings(tokens, concurrency=concurrency, repeat=repeat, threads=threads, context=context,
                        follow_up=follow_up)

    def start(ctx):
        text = np.random.default_rng(1).integers(0, ctx.rt.n_token, size=context + follow_up, dtype=np.int64)
        limits = ["--max-batch", str(concurrency), "--max-queue", str(4 * concurrency),
                  "--max-prompt-tokens", str(max(8192, context + follow_up))]
        servers = {"serve": [str(ctx.model_file), "--threads", str(threads), *limits]}
        if triton:
            repo = write_repository(ctx.model_file, ctx.tmp / "repo", backend="python", max_batch=concurrency,
                                    max_sequences=4 * concurrency, max_queue_delay_us=TRITON_QUEUE_DELAY_US,
                                    threads=threads)
            servers["serve --triton"] = ["--triton", ctx.stack.enter_context(TritonServer(repo)).grpc_url, *limits]
        sides = {}
        for i, (name, args) in enumerate(servers.items()):
            srv = load.ServeProcess(args, ctx.tmp / f"serve{i}.log")
            ctx.stack.callback(srv.close)
            srv.wait_ready()
            http_round(srv.url, ctx.prompts[:2], 4)  # warm-up
            log = [ln.strip() for ln in srv.log_path.read_text().splitlines() if "memory per session" in ln]
            ctx.result.update({"memory_per_session_log": log[-1]} if log else {})
            sides[name] = load.timed(name, lambda url=srv.url: http_round(url, ctx.prompts, tokens), tokens)
            sides["session " + name] = lambda r, url=srv.url, name=name: session_round(name, r, url, text[:context],
                                                                                       text[context:])
        return {**sides, BATCHED: load.timed(BATCHED, lambda: load.batched_round(ctx.rt, ctx.prompts, tokens), tokens)}

    result, raw = load.run(model, start, prompts=concurrency, prompt_len=prompt_len, repeat=repeat, threads=threads,
                           mem_len=mem_len, cache_dir=cache_dir, triton=triton, concurrency=concurrency,
                           tokens=tokens, context=context, follow_up=follow_up)
    servers = [name for name in raw if name != BATCHED and not name.startswith("session ")]
    result["paths"] = {name: load.summarise(raw[name], tokens, raw[BATCHED] if name != BATCHED else None)
                       for name in [*servers, BATCHED]}
    want = result["paths"][BATCHED]["tokens"]
    result["tokens_match"] = {name: all([r[2] for r in rnd] == want for rnd in raw[name]) for name in servers}
    result["sessions"] = {}
    for name in servers:
        rounds = raw["session " + name]
        cont, full = (np.array([s[k] for s in rounds]) * 1e3 for k in ("session_ttft_s", "resend_ttft_s"))
        result["sessions"][name] = {"session_ttft_ms": cont.tolist(), "resend_ttft_ms": full.tolist(),
                                    "speedup": float(np.median(full) / np.median(cont)),
                                    "same_token": all(s["same_token"] for s in rounds)}
    return result


# -- the report -------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    lines = [
        (f"Model: {load.model_sentence(result['model'])}, {result['threads']} ONNX Runtime thread(s) on every side. "
         f"{result['concurrency']} concurrent streams, each a {result['prompt_len']}-token prompt "
         f"({result['prompt_kind']}) and {result['tokens']} greedy tokens; {result['repeat']} interleaved rounds per "
         "path (tokens/s: the median round, slowest and fastest in brackets; latencies pool every stream of every "
         "round)."), "",
        *harness.table(["path", "tokens/s", "of in-process batched", "TTFT p50 ms", "TTFT p99 ms",
                        "inter-token p50 ms", "p99 ms"],
                       [[name, *load.rate_cells(p), f"{p['first_token_p50_ms']:.1f}", f"{p['first_token_p99_ms']:.1f}",
                         f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.1f}"] for name, p in result["paths"].items()],
                       numeric_from=1)]
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
    return "\n".join([*lines, "", load.measured_line(result["date"], result["machine"], result["versions"])]) + "\n"


def section(result: dict) -> list[str]:
    serve, s = result["paths"]["serve"], result["sessions"]["serve"]
    target = TARGETS.get("enwik8-base" if result["model"]["label"].startswith("enwik8-base") else None)
    lo, hi = (100 * f(serve["ratio_to_batched_rounds"]) for f in (min, max))
    return [(f"- Throughput at {result['concurrency']} streams: `serve` makes "
             f"**{100 * serve['ratio_to_batched']:.0f}%** of in-process batched tokens/s (rounds "
             f"{lo:.0f}-{hi:.0f}%; target {100 * target:.0f}%: "
             f"{'met' if serve['ratio_to_batched'] >= target else 'missed'})."),
            (f"- Session continuation with {result['context']} tokens of context: **{s['speedup']:.0f}x** "
             f"faster to the first token than re-sending it (target 20x: {'met' if s['speedup'] >= 20 else 'missed'})."),
            "", markdown(result)]


def results_file(results: list[dict], command: str) -> str:
    return load.results_file("HTTP serving: txl-deploy serve vs in-process, sessions", results, command, section)


def measure(args, command):
    results = [run_benchmark(model, args.concurrency, args.tokens, args.prompt_len, args.threads, args.repeat,
                             args.context, args.follow_up, triton=not args.no_triton, mem_len=args.mem_len,
                             cache_dir=args.cache_dir) for model in (args.model or [None])]
    return results_file(results, command), results, 0 if all(r["tokens_match"]["serve"] for r in results) else 1


def main(argv=None) -> int:
    p = load.parser("serve_load", __doc__, "results_serve.md", "the bundled demo model", concurrency=16, repeat=3)
    p.add_argument("--context", type=int, default=2000, help="tokens a session holds before its follow-up")
    p.add_argument("--follow-up", type=int, default=16, help="tokens of the follow-up")
    p.add_argument("--no-triton", action="store_true", help="leave out the serve --triton path")
    return harness.main("serve_load", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
