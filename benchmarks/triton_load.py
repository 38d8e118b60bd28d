"""Serving load: tokens/s and per-token latency through tritonserver's Python backend against the same model
in-process (C threads over one session) and batched in-process (the C conversations as rows of one `TxlRuntime`,
the yardstick), every conversation's tokens compared. Method and figures: docs/benchmarks.md ("Serving")."""

from __future__ import annotations

import logging
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks import harness
from benchmarks import serving_load as load
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.triton.client import TxlTritonClient
from txl_deploy.serving.triton.local_server import TritonServer
from txl_deploy.serving.triton.repository import DEFAULT_QUEUE_DELAY_US, write_repository

logger = logging.getLogger(__name__)

# A run without --model: the configuration the documentation quotes. A 16-row step of the enwik8-base shape (about
# 100 ms on 2 cores) can afford to hold a request 10 ms for its batch to fill, the demo model's (7 ms) 4 ms;
# triton-repo's default (1 ms, for other --model runs) splits 16 conversations' requests into more executions.
DEFAULT_MODELS = (("enwik8-base", 10000), (None, 4000))
TIMEOUT = 300.0  # seconds; a request or barrier waiting longer than this means something is stuck
STATS_SETTLE_S = 30.0  # how long Triton may take to count requests whose responses the clients already have


# -- measuring ------------------------------------------------------------------------------------------------------
def _concurrently(n: int, tokens_of):
    """n conversations in threads, each timed once all are ready: (start, token times, tokens) of each, where
    `tokens_of(i)` generates conversation i's tokens."""
    barrier = threading.Barrier(n)

    def one(i):
        barrier.wait(timeout=TIMEOUT)
        t0, stamps, toks = time.perf_counter(), [], []
        for tok in tokens_of(i):
            stamps.append(time.perf_counter())
            toks.append(int(tok))
        return t0, stamps, toks

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _server_stats(client, model: str) -> dict:
    """Triton's cumulative per-model counters (requests, executions, queue and compute nanoseconds)."""
    s = client._client.get_inference_statistics(model, as_json=True)["model_stats"][0]
    inf = s.get("inference_stats", {})
    return {"requests": int(inf.get("success", {}).get("count", 0)), "executions": int(s.get("execution_count", 0)),
            **{f"{k}_ns": int(inf.get(k, {}).get("ns", 0)) for k in ("queue", "compute_infer", "success")}}


def _stats_after(client, model: str, before: dict, sent: int) -> dict:
    """Triton's counters once they include all `sent` requests (it records a request after the client has the
    response, so a read right after a round can miss the last ones), up to STATS_SETTLE_S."""
    deadline = time.monotonic() + STATS_SETTLE_S
    while True:
        after = _server_stats(client, model)
        if after["requests"] - before["requests"] >= sent or time.monotonic() > deadline:
            return after
        time.sleep(0.02)


def server_round(url: str, prompts, n_tokens: int, model: str = "txl"):
    """C = len(prompts) concurrent conversations through the server, one client (gRPC channel) each. Returns their
    streams and the change in Triton's counters (read once they count every request the clients completed,
    `client_requests`)."""
    sent, lock = [0], threading.Lock()
    clients = [TxlTritonClient(url, model=model, timeout=TIMEOUT) for _ in prompts]
    for client in clients:  # every request of a conversation, its END included, goes through _request once
        def request(*args, real=client._request, **kwargs):
            out = real(*args, **kwargs)
            with lock:
                sent[0] += 1
            return out
        client._request = request
    before = _server_stats(clients[0], model)

    def tokens_of(i):
        with clients[i].conversation() as conv:
            yield from conv.generate(prompts[i], max_new_tokens=n_tokens)

    try:
        runs = _concurrently(len(prompts), tokens_of)
        after = _stats_after(clients[0], model, before, sent[0])
    finally:
        for cl in clients:
            cl.close()
    return runs, {**{k: after[k] - before[k] for k in after}, "client_requests": sent[0]}


def _server_columns(deltas) -> dict:
    d = {k: sum(x[k] for x in deltas) for k in deltas[0]}
    if not d["requests"]:
        return {}
    # Triton charges every request of a batch the whole batch's execute() time: compute_infer / requests is the
    # average execute() duration a request sat in, not a per-request cost.
    return {"server_requests": d["requests"], "client_requests": d["client_requests"],
            "server_queue_ms": d["queue_ns"] / d["requests"] / 1e6,
            "server_execute_ms": d["compute_infer_ns"] / d["requests"] / 1e6,
            "mean_batch": d["requests"] / max(1, d["executions"])}


def inprocess_round(shared, prompts, n_tokens: int):
    """The same conversations in this process: C threads, a TxlRuntime (own memory) each, one shared session."""
    rts = [TxlRuntime(shared.backend) for _ in prompts]  # not closed: closing would close the shared session
    return _concurrently(len(prompts), lambda i: rts[i].generate(prompts[i], max_new_tokens=n_tokens, temperature=0))


# -- the whole benchmark ---------------------------------------------------------------------------------------------
def run_benchmark(model=None, concurrency=(1, 16), tokens: int = 64, instances=(1,), prompt_len: int = 48,
                  max_batch: int = 16, queue_delay_us: int = DEFAULT_QUEUE_DELAY_US, repeat: int = 5,
                  threads: int | None = 1, mem_len: int = load.DEFAULT_SHAPE_MEM_LEN, cache_dir=None) -> dict:
    """Server rounds (one server per instance count), in-process and batched rounds at each concurrency, all
    interleaved; `result["tokens_match"]`: every conversation's greedy tokens equal on every path."""
    concurrency, instances = [int(c) for c in concurrency], [int(i) for i in instances]
    load.check_settings(tokens, concurrency=concurrency, instances=instances, repeat=repeat, threads=threads)

    def start(ctx):
        sides, prompts = {}, ctx.prompts
        for count in instances:
            repo = write_repository(ctx.model_file, ctx.tmp / f"repo{count}", backend="python", max_batch=max_batch,
                                    instances=count, max_sequences=max(max(concurrency), max_batch),
                                    max_queue_delay_us=queue_delay_us, threads=threads)
            logger.info(f"starting tritonserver with {count} instance(s) of the python backend ...")
            url = ctx.stack.enter_context(TritonServer(repo)).grpc_url  # stopped on leaving, errors and Ctrl-C too
            server_round(url, prompts[:2 * count], 4)  # warm-up: every instance's session
            sides.update({(count, c): load.timed(f"server {count} inst.", lambda u=url, c=c: server_round(
                u, prompts[:c], tokens), tokens) for c in concurrency})
        probe = TxlTritonClient(url, timeout=TIMEOUT)
        ctx.result["tritonserver"] = probe._client.get_server_metadata(as_json=True).get("version")
        probe.close()
        inprocess_round(ctx.rt, prompts[:2], 4)  # warm-up
        for c in concurrency:
            sides["in-process", c] = load.timed("in-process", lambda c=c: inprocess_round(ctx.rt, prompts[:c], tokens),
                                                tokens)
            sides["batched", c] = load.timed("in-process batched", lambda c=c: load.batched_round(
                ctx.rt, prompts[:c], tokens), tokens)
        return sides

    result, raw = load.run(model, start, prompts=max(concurrency), prompt_len=prompt_len, repeat=repeat,
                           threads=threads, mem_len=mem_len, cache_dir=cache_dir, tokens=tokens,
                           concurrency=concurrency, instances=instances, max_batch=max_batch,
                           queue_delay_us=queue_delay_us)
    # a server's round is (its streams, the change in Triton's counters)
    result["server"] = [{"instances": count, **load.summarise([runs for runs, _ in raw[count, c]], tokens,
                                                              raw["batched", c]),
                         **_server_columns([delta for _, delta in raw[count, c]])}
                        for count in instances for c in concurrency]
    result["in_process"] = [load.summarise(raw["in-process", c], tokens) for c in concurrency]
    result["in_process_batched"] = [load.summarise(raw["batched", c], tokens) for c in concurrency]
    reference = {row["concurrency"]: row["tokens"] for row in result["in_process"]}
    result["tokens_match"] = all(row["tokens"] == reference[row["concurrency"]] and row["tokens_same_every_round"]
                                 for row in result["server"] + result["in_process"])
    # A batch runs other kernels than one row (BLAS blocking), so its float results may differ in the last bits;
    # with a trained model greedy tokens still agree, with random weights a near-tie can flip. Reported, not required.
    result["batched_tokens_match"] = all(row["tokens"] == reference[row["concurrency"]]
                                         for row in result["in_process_batched"])
    return result


# -- the report -------------------------------------------------------------------------------------------------------
def settings_table(result: dict) -> list[str]:
    """Everything a run depended on, so that two runs can be compared line by line."""
    v, mach = result["versions"], result["machine"]
    rows = [
        ("model", load.model_sentence(result["model"])),
        ("ONNX Runtime threads", f"{result['threads'] or 'default (one per core)'}, in-process and per server instance"),
        ("sequence batcher max_queue_delay", f"{result['queue_delay_us']} us"),
        ("max_batch", str(result["max_batch"])),
        ("server instances", ", ".join(map(str, result["instances"]))),
        ("conversations (concurrency)", ", ".join(map(str, result["concurrency"]))),
        ("prompt", f"{result['prompt_len']} tokens per conversation ({result['prompt_kind']})"),
        ("tokens generated", f"{result['tokens']} greedy tokens per conversation, one request each"),
        ("rounds", f"{result['repeat']} per row, interleaved"),
        ("load average (1 min)", f"{mach['load_average_start'][0]:.1f} at the start, "
                                 f"{mach['load_average_end'][0]:.1f} at the end; round by round: "
                                 + ", ".join(f"{x:.1f}" for x in result.get("load_average_rounds", []))),
        ("machine", f"{mach['cpus']} CPU cores ({mach['cpu']}, {mach['system']})"),
        ("versions", ", ".join(f"{name} {v[name]}" for name in v)),
        ("date", result["date"]),
    ]
    return harness.table(["setting", "value"], rows)


def _paths(result: dict) -> list:
    """(what, row) of every row measured: the servers', in-process, in-process batched."""
    return [("Triton gRPC", r) for r in result["server"]] + [("in-process", r) for r in result["in_process"]] + \
        [("in-process batched", r) for r in result.get("in_process_batched", [])]


def rounds_table(result: dict) -> list[str]:
    """Every round of every row: tokens/s, and the server's share of batched in-process tokens/s."""
    head = ["path", "instances", "conversations", *[f"round {r + 1}" for r in range(result["repeat"])],
            "min / median / max"]
    rows = [[f"{what}, tokens/s", r.get("instances", "-"), r["concurrency"],
             *(f"{x:.0f}" for x in r["tokens_per_s_rounds"]), load.spread(r["tokens_per_s_rounds"])]
            for what, r in _paths(result)]
    rows += [["Triton / in-process batched", r["instances"], r["concurrency"],
              *(f"{100 * x:.0f}%" for x in r["ratio_to_batched_rounds"]),
              f"**{load.spread(r['ratio_to_batched_rounds'], pct=True)}**"] for r in result["server"]]
    return harness.table(head, rows, numeric_from=1)


def markdown(result: dict) -> str:
    """The tables (and how it was measured) as Markdown."""
    lines = [
        ("Server: tritonserver's python backend (one batched runtime call per batch), gRPC on 127.0.0.1, client "
         "threads here. In-process: a thread and a TxlRuntime per conversation over one ONNX Runtime session; batched: "
         "the conversations as the rows of one TxlRuntime. Ratio: server over batched tokens/s per round, median. "
         "Tokens/s: the median round (slowest, fastest); latencies pool every token gap of every round, the first "
         "token (with the prompt) apart."), "",
        *harness.table(["path", "instances", "conversations", "tokens/s", "of batched in-process", "p50 ms/token",
                        "p99 ms/token", "mean ms/token", "p50 first token ms", "Triton queue ms/request",
                        "execute() ms a request sat in", "requests per execute()"],
                       [[what, r.get("instances", "-"), r["concurrency"], *load.rate_cells(r), f"{r['p50_ms']:.2f}",
                         f"{r['p99_ms']:.1f}", f"{r['mean_ms']:.2f}", f"{r['first_token_p50_ms']:.1f}",
                         *((f"{r['server_queue_ms']:.2f}", f"{r['server_execute_ms']:.2f}", f"{r['mean_batch']:.2f}")
                           if "server_queue_ms" in r else ("-",) * 3)] for what, r in _paths(result)],
                       numeric_from=1),
        "", "Every round, in the order measured (min / median / max over the rounds):", "", *rounds_table(result), "",
        ("Every conversation's greedy tokens through the server equal its tokens in-process: "
         f"**{'yes' if result['tokens_match'] else 'NO'}**. Batched in-process tokens equal them too: "
         f"{'yes' if result.get('batched_tokens_match') else 'no (float differences of a batched run; see JSON)'}."),
        "", "What the run depended on:", "", *settings_table(result)]
    return "\n".join(lines) + "\n"


def section(result: dict) -> list[str]:
    lines = []
    for row in result["server"]:
        c, inst = row["concurrency"], row["instances"]
        lines.append(f"- {c} conversation{'s' if c > 1 else ''}, {inst} instance{'s' if inst > 1 else ''}, "
                     f"max_queue_delay {result['queue_delay_us']} us: the server makes "
                     f"**{100 * row['ratio_to_batched']:.0f}%** of the batched in-process tokens/s (min / median "
                     f"/ max over {len(row['ratio_to_batched_rounds'])} rounds: "
                     f"{load.spread(row['ratio_to_batched_rounds'], pct=True)}; {row['tokens_per_s']:.0f} tokens/s; "
                     f"per token p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms; "
                     f"{row.get('mean_batch', 0):.1f} requests per execute()).")
    return [*lines, "", markdown(result)]


def results_file(results: list[dict], command: str) -> str:
    return load.results_file("Serving load: Triton Inference Server vs in-process", results, command, section,
                             " Every round is listed; each section ends with everything its run depended on.")


def measure(args, command):
    models = args.model or [model for model, _ in DEFAULT_MODELS]
    delays = args.queue_delay_us or ([DEFAULT_QUEUE_DELAY_US] if args.model else [d for _, d in DEFAULT_MODELS])
    if len(delays) not in (1, len(models)):
        raise InputError(f"--queue-delay-us has {len(delays)} values for {len(models)} models: one, or one per --model")
    results = [run_benchmark(model, args.concurrency, args.tokens, args.instances, args.prompt_len, args.max_batch,
                             delay, args.repeat, threads=args.threads or None, mem_len=args.mem_len,
                             cache_dir=args.cache_dir)
               for model, delay in zip(models, delays * len(models) if len(delays) == 1 else delays)]
    return results_file(results, command), results, 0 if all(r["tokens_match"] for r in results) else 1


def main(argv=None) -> int:
    p = load.parser("triton_load", __doc__, "results_triton.md", "enwik8-base, then the bundled demo model",
                    concurrency=[1, 16], repeat=5)
    p.add_argument("--instances", type=harness.int_list, default=[1], help="Triton model instances, one server each")
    p.add_argument("--max-batch", type=int, default=16, help="the repository's max_batch_size")
    p.add_argument("--queue-delay-us", type=harness.int_list, help="the sequence batcher's max queue delay, one or "
                   "one per --model (default: 10000,4000 for the default models, else triton-repo's)")
    return harness.main("triton_load", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
