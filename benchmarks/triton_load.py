"""Serving load: tokens/s and per-token latency through tritonserver's Python backend against the same model
in-process (C threads over one session) and batched in-process (the C conversations as rows of one `TxlRuntime`,
the yardstick), every conversation's tokens compared. Method and figures: docs/benchmarks.md ("Serving")."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import harness
from benchmarks import serving_load as load
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.triton.client import TxlTritonClient
from txl_deploy.serving.triton.local_server import TritonServer, find_tritonserver
from txl_deploy.serving.triton.repository import DEFAULT_QUEUE_DELAY_US, write_repository

logger = logging.getLogger(__name__)

DEFAULT_CONCURRENCY = (1, 16)
DEFAULT_MAX_BATCH = 16
DEFAULT_THREADS = 1
DEFAULT_TOKENS = 64
DEFAULT_PROMPT_LEN = 48
DEFAULT_REPEAT = 5
# A run without --model measures these models with these sequence-batcher delays: the configuration the
# documentation quotes. A step of the enwik8-base shape (about 100 ms for 16 rows on 2 cores) can afford to hold
# a request 10 ms for its batch to fill; the demo model's (about 7 ms) 4 ms. triton-repo's own default (1 ms)
# splits 16 conversations' requests, which arrive over several milliseconds from the client threads, into more
# executions: other --model runs use it unless --queue-delay-us says otherwise.
DEFAULT_MODELS = (("enwik8-base", 10000), (None, 4000))
TIMEOUT = 300.0  # seconds; a request or barrier waiting longer than this means something is stuck
STATS_SETTLE_S = 30.0  # how long Triton may take to count requests whose responses the clients already have


# -- measuring ------------------------------------------------------------------------------------------------------
def _stream(tokens_iter, barrier):
    """Timestamps of every token a generator yields, after all conversations of the round are ready."""
    barrier.wait(timeout=TIMEOUT)
    t0 = time.perf_counter()
    stamps, toks = [], []
    for tok in tokens_iter():
        stamps.append(time.perf_counter())
        toks.append(int(tok))
    return t0, stamps, toks


def _server_stats(client, model: str) -> dict:
    """Triton's cumulative per-model counters (requests, executions, queue and compute nanoseconds)."""
    raw = client._client.get_inference_statistics(model, as_json=True)
    s = raw["model_stats"][0]
    inf = s.get("inference_stats", {})
    ns = {k: int(inf.get(k, {}).get("ns", 0)) for k in ("queue", "compute_infer", "success")}
    return {"requests": int(inf.get("success", {}).get("count", 0)), "executions": int(s.get("execution_count", 0)),
            **{f"{k}_ns": v for k, v in ns.items()}}


def _counting_requests(client, counter: list, lock):
    """Count every request `client` completes (every request of a conversation, its END included, goes through
    client._request once)."""
    real = client._request

    def request(*args, **kwargs):
        out = real(*args, **kwargs)
        with lock:
            counter[0] += 1
        return out

    client._request = request
    return client


def _stats_after(client, model: str, before: dict, sent: int) -> dict:
    """Triton's counters once they include all `sent` requests. A client has its response before the server has
    recorded the request in its statistics (the last ones, e.g. the END requests, can be missing from a read
    right after the round on a loaded machine), so wait until the count covers them, up to STATS_SETTLE_S."""
    deadline = time.monotonic() + STATS_SETTLE_S
    while True:
        after = _server_stats(client, model)
        if after["requests"] - before["requests"] >= sent or time.monotonic() > deadline:
            return after
        time.sleep(0.02)


def server_round(url: str, prompts, n_tokens: int, model: str = "txl"):
    """C = len(prompts) concurrent conversations through the server, one client (gRPC channel) each.
    Returns the conversations' (start, token times, tokens) and the change in Triton's counters (read once they
    include every request the clients completed; `client_requests` is that number)."""
    c = len(prompts)
    sent, lock = [0], threading.Lock()
    clients = [_counting_requests(TxlTritonClient(url, model=model, timeout=TIMEOUT), sent, lock) for _ in range(c)]
    barrier = threading.Barrier(c)
    before = _server_stats(clients[0], model)

    def one(i):
        with clients[i].conversation() as conv:
            return _stream(lambda: conv.generate(prompts[i], max_new_tokens=n_tokens), barrier)

    try:
        with ThreadPoolExecutor(c) as pool:
            runs = list(pool.map(one, range(c)))
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
    c = len(prompts)
    barrier = threading.Barrier(c)

    def one(i):
        rt = TxlRuntime(shared.backend)  # not closed: closing would close the shared session
        return _stream(lambda: rt.generate(prompts[i], max_new_tokens=n_tokens, temperature=0), barrier)

    with ThreadPoolExecutor(c) as pool:
        return list(pool.map(one, range(c)))


# -- the whole benchmark ---------------------------------------------------------------------------------------------
def _load_runtime(model_file: Path, threads):
    """The in-process runtime, with the ONNX Runtime thread count the server's instances get."""
    if model_file.suffix.lower() == ".onnx":
        return TxlRuntime.load(model_file, providers=["cpu"], threads=threads)
    return TxlRuntime.load(model_file)


def run_benchmark(model=None, concurrency=DEFAULT_CONCURRENCY, tokens: int = DEFAULT_TOKENS, instances=(1,),
                  prompt_len: int = DEFAULT_PROMPT_LEN, max_batch: int = DEFAULT_MAX_BATCH,
                  queue_delay_us: int = DEFAULT_QUEUE_DELAY_US, repeat: int = DEFAULT_REPEAT,
                  threads: int = DEFAULT_THREADS, mem_len: int = load.DEFAULT_SHAPE_MEM_LEN, cache_dir=None) -> dict:
    """Server rounds (per instance count) and in-process rounds at each concurrency; returns everything as a dict.

    One server per instance count runs for the whole benchmark, and the rounds are interleaved (for each repeat,
    each concurrency: every server, then in-process, in reverse order every other round), so a change in the
    machine's other load hits all paths alike. `result["tokens_match"]` says whether every conversation produced
    the same greedy tokens on every path."""
    concurrency = [int(c) for c in concurrency]
    instances = [int(i) for i in instances]
    if tokens < 2:
        raise InputError("--tokens must be at least 2 (per-token latency is the gap between two tokens)")
    if not concurrency or min(concurrency) < 1 or not instances or min(instances) < 1 or repeat < 1:
        raise InputError("--concurrency, --instances and --repeat must be positive integers")
    if threads is not None and threads < 1:
        raise InputError("--threads must be a positive integer")
    find_tritonserver()  # fail before the export if there is no server
    result = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "machine": load.machine(),
              "tokens": tokens, "prompt_len": prompt_len, "concurrency": concurrency, "instances": instances,
              "max_batch": max_batch, "queue_delay_us": queue_delay_us, "repeat": repeat, "threads": threads,
              "server": [], "in_process": []}
    with tempfile.TemporaryDirectory(prefix="txl-triton-load-") as tmp, ExitStack() as stack:
        tmp = Path(tmp)
        model_file, label = load.prepare_model(model, tmp, mem_len=mem_len, cache_dir=cache_dir)
        shared = _load_runtime(model_file, threads)
        stack.callback(shared.close)
        result["model"] = load.model_fields(label, model_file, shared)
        prompts, result["prompt_kind"] = load.make_prompts(shared.vocab, shared.n_token, max(concurrency), prompt_len)
        servers = {}
        for count in instances:
            repo = write_repository(model_file, tmp / f"repo{count}", backend="python", max_batch=max_batch,
                                    instances=count, max_sequences=max(max(concurrency), max_batch),
                                    max_queue_delay_us=queue_delay_us, threads=threads)
            logger.info(f"starting tritonserver with {count} instance(s) of the python backend ...")
            servers[count] = stack.enter_context(TritonServer(repo))  # stopped on leaving, errors and Ctrl-C too
            server_round(servers[count].grpc_url, prompts[:2 * count], 4)  # warm-up: every instance's session
        probe = TxlTritonClient(servers[instances[0]].grpc_url, timeout=TIMEOUT)
        server_version = probe._client.get_server_metadata(as_json=True).get("version")
        probe.close()
        inprocess_round(shared, prompts[:2], 4)  # warm-up
        load.batched_round(shared, prompts[:2], 4)
        raw = {(path, c): [] for c in concurrency for path in [*instances, "in-process", "batched"]}
        stats = {(count, c): [] for c in concurrency for count in instances}

        def server_path(count, server, c, r):
            runs, delta = server_round(server.grpc_url, prompts[:c], tokens)
            raw[count, c].append(runs)
            stats[count, c].append(delta)
            logger.info(load.round_line(f"server {count} inst.", r, runs, tokens))

        def local_path(c, r):
            raw["in-process", c].append(inprocess_round(shared, prompts[:c], tokens))
            logger.info(load.round_line("in-process", r, raw["in-process", c][-1], tokens))

        def batched_path(c, r):
            raw["batched", c].append(load.batched_round(shared, prompts[:c], tokens))
            logger.info(load.round_line("in-process batched", r, raw["batched", c][-1], tokens))

        result["load_average_rounds"] = []
        for r in range(repeat):
            result["load_average_rounds"].append(os.getloadavg()[0])  # the machine's other load, round by round
            for c in concurrency:
                paths = [lambda count=count, server=server: server_path(count, server, c, r)
                         for count, server in servers.items()]
                paths += [lambda: local_path(c, r), lambda: batched_path(c, r)]
                for path in (paths if r % 2 == 0 else reversed(paths)):
                    path()
    for count in instances:
        for c in concurrency:
            result["server"].append({"instances": count, **load.summarise(raw[count, c], tokens, raw["batched", c]),
                                     **_server_columns(stats[count, c])})
    result["in_process"] = [load.summarise(raw["in-process", c], tokens) for c in concurrency]
    result["in_process_batched"] = [load.summarise(raw["batched", c], tokens) for c in concurrency]
    reference = {row["concurrency"]: row["tokens"] for row in result["in_process"]}
    rows = result["server"] + result["in_process"]
    result["tokens_match"] = all(row["tokens"] == reference[row["concurrency"]] and row["tokens_same_every_round"]
                                 for row in rows)
    # A batch runs other kernels than one row (BLAS blocking), so its float results may differ in the last bits;
    # with a trained model greedy tokens still agree, with random weights a near-tie can flip. Reported, not required.
    result["batched_tokens_match"] = all(row["tokens"] == reference[row["concurrency"]]
                                         for row in result["in_process_batched"])
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["versions"] = load.versions(server_version)
    return result


def settings_table(result: dict) -> list[str]:
    """Everything a run depends on, so that two runs can be compared line by line."""
    m, v, mach = result["model"], result["versions"], result["machine"]
    rows = [
        ("model", f"{m['label']} (`{m['file']}`: {m['n_layer']} layers, d_model {m['d_model']}, mem_len "
                  f"{m['mem_len']}, {m['n_token']} tokens, max_segment {m['max_segment']}, ONNX Runtime CPU fp32)"),
        ("ONNX Runtime threads", f"{result['threads'] or 'default (one per core)'}, in-process and per server instance"),
        ("sequence batcher max_queue_delay", f"{result['queue_delay_us']} us"),
        ("max_batch", str(result["max_batch"])),
        ("server instances", ", ".join(map(str, result["instances"]))),
        ("conversations (concurrency)", ", ".join(map(str, result["concurrency"]))),
        ("prompt", f"{result['prompt_len']} tokens per conversation ({result['prompt_kind']})"),
        ("tokens generated", f"{result['tokens']} greedy tokens per conversation, one request each"),
        ("rounds", f"{result['repeat']} per row, interleaved"),
        ("load average (1 min)", f"{mach['load_average_start'][0]:.1f} at the start, "
                                 f"{mach['load_average_end'][0]:.1f} at the end; at each round's start: "
                                 + ", ".join(f"{x:.1f}" for x in result.get("load_average_rounds", []))),
        ("machine", f"{mach['cpus']} CPU cores ({mach['cpu']}, {mach['system']})"),
        ("versions", f"Python {v['python']}, txl-deploy {v['txl-deploy']}, tritonserver {v['tritonserver']}, "
                     f"tritonclient {v['tritonclient']}, onnxruntime {v['onnxruntime']}, numpy {v['numpy']}, "
                     f"grpcio {v['grpcio']}"),
        ("date", result["date"]),
    ]
    return harness.table(["setting", "value"], rows)


def rounds_table(result: dict) -> list[str]:
    """Every round of every row: tokens/s, and the server's share of batched in-process tokens/s."""
    n = result["repeat"]
    head = ["path", "instances", "conversations", *[f"round {r + 1}" for r in range(n)], "min / median / max"]
    rows = [[f"{what}, tokens/s", r.get("instances", "-"), r["concurrency"],
             *(f"{x:.0f}" for x in r["tokens_per_s_rounds"]), load.spread(r["tokens_per_s_rounds"])]
            for what, r in _paths(result)]
    rows += [["Triton / in-process batched", r["instances"], r["concurrency"],
              *(f"{100 * x:.0f}%" for x in r["ratio_to_batched_rounds"]),
              f"**{load.spread(r['ratio_to_batched_rounds'], pct=True)}**"] for r in result["server"]]
    return harness.table(head, rows, numeric_from=1)


def _paths(result: dict) -> list:
    """(what, row) of every row measured: the servers', in-process, in-process batched."""
    return [("Triton gRPC", r) for r in result["server"]] + [("in-process", r) for r in result["in_process"]] + \
        [("in-process batched", r) for r in result.get("in_process_batched", [])]


def markdown(result: dict) -> str:
    """The tables (and how it was measured) as Markdown."""
    m, v = result["model"], result["versions"]
    lines = [
        (f"Model: {load.model_sentence(m)}, {_threads(result)} on both sides). Each conversation: a "
         f"{result['prompt_len']}-token prompt ({result['prompt_kind']}), then {result['tokens']} greedy tokens, one "
         f"request per token. Server: tritonserver {v['tritonserver']} python backend (one batched runtime call per "
         f"batch), max_batch {result['max_batch']}, sequence batcher max_queue_delay {result['queue_delay_us']} us, "
         "gRPC on 127.0.0.1, client threads in the benchmark's process. In-process: one thread and one TxlRuntime "
         "per conversation over one shared ONNX Runtime session; in-process, batched: the conversations as the rows "
         "of one TxlRuntime, one ONNX Runtime run per token. The ratio is server tokens/s over batched in-process "
         "tokens/s, per round (neighbours in time), median. "
         f"{result['repeat']} interleaved rounds per row: tokens/s is the median round (all conversations' tokens / "
         "wall time; the slowest and fastest round in brackets); latencies pool every token gap of every round "
         "(the first token, which includes the prompt, is its own column)."),
        "",
    ]
    head = ["path", "instances", "conversations", "tokens/s", "of batched in-process", "p50 ms/token", "p99 ms/token",
            "mean ms/token", "p50 first token ms", "Triton queue ms/request", "execute() ms a request sat in",
            "requests per execute()"]
    rows = [[what, r.get("instances", "-"), r["concurrency"], *load.rate_cells(r), f"{r['p50_ms']:.2f}",
             f"{r['p99_ms']:.1f}", f"{r['mean_ms']:.2f}", f"{r['first_token_p50_ms']:.1f}",
             *((f"{r['server_queue_ms']:.2f}", f"{r['server_execute_ms']:.2f}", f"{r['mean_batch']:.2f}")
               if "server_queue_ms" in r else ("-",) * 3)] for what, r in _paths(result)]
    lines += harness.table(head, rows, numeric_from=1)
    lines += [
        "",
        "Every round, in the order measured (min / median / max over the rounds):",
        "",
        *rounds_table(result),
        "",
        ("Every conversation's greedy tokens through the server equal its tokens in-process: "
         f"**{'yes' if result['tokens_match'] else 'NO'}**. Batched in-process tokens equal them too: "
         f"{'yes' if result.get('batched_tokens_match') else 'no (float differences of a batched run; see JSON)'}."),
        "",
        "What the run depended on:",
        "",
        *settings_table(result),
    ]
    return "\n".join(lines) + "\n"


def _threads(result) -> str:
    t = result.get("threads")
    return "ONNX Runtime's default threads" if not t else f"{t} ONNX Runtime thread{'s' if t > 1 else ''}"


def results_file(results: list[dict], command: str) -> str:
    """The whole results file: what produced it, where and when, then one section per model."""
    first = results[0]
    mach = first["machine"]
    lines = [
        (f"Machine: {mach['cpus']} CPU cores ({mach['cpu']}, {mach['system']}), load average "
         f"{mach['load_average_start'][0]:.1f} at the start (the machine's other work). Absolute speeds move with "
         "that load (every round is listed); the ratios compare paths measured in alternating rounds of the same "
         "run, with the same ONNX Runtime threads on both sides. Each model's section ends with everything its run "
         "depended on."),
        "",
    ]
    for result in results:
        m = result["model"]
        lines += [f"## {m['label']}", ""]
        for row in result["server"]:
            c, inst = row["concurrency"], row["instances"]
            lines.append(f"- {c} conversation{'s' if c > 1 else ''}, {inst} instance{'s' if inst > 1 else ''}, "
                         f"max_queue_delay {result['queue_delay_us']} us: the server makes "
                         f"**{100 * row['ratio_to_batched']:.0f}%** of the batched in-process tokens/s (min / median "
                         f"/ max over {len(row['ratio_to_batched_rounds'])} rounds: "
                         f"{load.spread(row['ratio_to_batched_rounds'], pct=True)}; "
                         f"{row['tokens_per_s']:.0f} tokens/s; per token p50 {row['p50_ms']:.1f} ms, "
                         f"p99 {row['p99_ms']:.1f} ms; {row.get('mean_batch', 0):.1f} requests per execute()).")
        lines += ["", markdown(result)]
    return harness.results_markdown("Serving load: Triton Inference Server vs in-process", "\n".join(lines), command)


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
    p = harness.parser("triton_load", __doc__, md="results_triton.md")
    p.add_argument("--model", action="append", help="an .onnx file, a checkpoint or a shape name, repeatable "
                   "(default: enwik8-base, then the bundled demo model)")
    p.add_argument("--mem-len", type=int, default=load.DEFAULT_SHAPE_MEM_LEN, help="memory length of a shape stand-in")
    p.add_argument("--concurrency", type=harness.int_list, default=list(DEFAULT_CONCURRENCY),
                   help="concurrent conversations per round, comma-separated")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="greedy tokens per conversation")
    p.add_argument("--instances", type=harness.int_list, default=[1], help="Triton model instances, one server each")
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="prompt tokens per conversation")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="the repository's max_batch_size")
    p.add_argument("--queue-delay-us", type=harness.int_list, help="the sequence batcher's max queue delay, one or "
                   "one per --model (default: 10000,4000 for the default models, else triton-repo's)")
    p.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="rounds per row, interleaved across paths")
    return harness.main("triton_load", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
