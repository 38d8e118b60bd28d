"""Chaos against `txl-deploy serve`: minutes of mixed load and client-side faults over loopback (`chaos_mix`), then
what must hold once the server is idle again, one list of failures per criterion (`CRITERIA`). Method and
figures: docs/benchmarks.md ("Serving"); the suite runs a one-minute version (tests/serving/http/test_serve_chaos.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import re
import secrets
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from benchmarks import harness
from benchmarks.chaos_mix import ANSWERED, BUSY, CRITERIA, JUNK, MIX, OK, ChaosClient, ChaosSettings, Hang, Target
from benchmarks.serving_load import ServeProcess, machine, measured_line, prepare_model, runtime_reference, versions
from txl_deploy.bench.peak_usage import rss_bytes
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime

logger = logging.getLogger(__name__)

# The server's routes: the endpoint label set may hold these and one label for every other path.
ROUTES = ("/v1/completions", "/v1/models", "/v1/sessions", "/v1/sessions/{id}", "/v1/sessions/{id}/park",
          "/v1/sessions/{id}/restore", "/health", "/metrics")
MAX_PROMPT = 512


# -- what the server's process holds ----------------------------------------------------------------------------
def open_fds(pid: int) -> list[str]:
    """What the process's file descriptors point at (sockets, files, pipes)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed in between
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def fd_kinds(pid: int) -> dict:
    """Open descriptors by kind: socket, pipe, anon_inode:[eventfd], or the file's path."""
    return dict(Counter(re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", t) for t in open_fds(pid)))


def metric_value(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


# -- the run -----------------------------------------------------------------------------------------------------
class _Broken(Exception):
    """A golden conversation could not go on: its error."""


class _Chaos(ChaosClient):
    """The run: the warm-up and the chaos (workers and golden conversations), the capacity probe, the checks."""

    def __init__(self, target: Target, settings: ChaosSettings, reference):
        super().__init__(target, settings)
        self.reference, self.ops, self.op_counts, self.stop = reference, 0, Counter(), asyncio.Event()
        self.rss_samples, self.golden_log = [], []  # (time, bytes); each golden conversation's log

    async def guarded(self, coro, what: str, timeout: float | None = None, prefix: str = ""):
        """`coro`; no answer in time is a hang, and ends the run (the rest would only wait as long)."""
        try:
            return await asyncio.wait_for(coro, timeout)
        except (Hang, asyncio.TimeoutError) as e:
            self.fail("hangs", f"{prefix}{e}" if str(e) else f"{what}: not done within {timeout:g} s")
            self.stop.set()

    # -- golden sessions: their segments and answers go to golden_log, checked against the reference after the run
    async def golden(self, k: int, until: float):
        """Golden conversations one after another until `until`; some are parked and restored between turns."""
        for j in itertools.count():
            if self.stop.is_set() or time.monotonic() >= until:
                return
            log = {"id": f"golden-{k}-{j}", "segments": [], "got": [], "restored": 0, "error": None}
            self.golden_log.append(log)
            try:
                await self.golden_conversation(random.Random(f"golden-{self.s.seed}-{k}-{j}"), log)
            except _Broken as e:
                log["error"] = str(e)

    async def must(self, status: int, what: str, method: str, path: str, **kw):
        """A golden request that must be answered `status`, else the conversation ends with `what` as its error."""
        got = await self.request("golden", method, path, {status}, **kw)
        if not got or got[0] != status:
            raise _Broken(f"{what}: {got and got[0]}")
        return got

    async def golden_conversation(self, rng: random.Random, log: dict):
        sid = f"{log['id']}-0"
        await self.must(201, f"could not create {sid}", "POST", "/v1/sessions", json_body={"id": sid})
        for turn in range(self.s.golden_turns):
            prompt = [] if turn and rng.random() < 0.25 else [rng.randrange(self.n_token)
                                                             for _ in range(rng.randint(1, 40))]
            n = rng.randint(1, 8)
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "return_token_ids": True,
                    "session_id": sid}
            try:
                answer = await asyncio.wait_for(self.golden_turn(body, rng.random() < 0.5), self.s.timeout_s + 5)
            except asyncio.TimeoutError:
                raise Hang(f"golden: turn {turn} on {sid}: not done within {self.s.timeout_s + 5:g} s") from None
            if isinstance(answer, str):
                raise _Broken(f"turn {turn} on {sid}: {answer}")
            log["segments"].append((prompt, n))
            log["got"].append(answer)
            if rng.random() < 0.4:
                got = await self.must(OK, f"park of {sid} after turn {turn}", "POST", f"/v1/sessions/{sid}/park")
                sid = f"{log['id']}-{turn + 1}"
                await self.must(201, f"restore as {sid} after turn {turn}", "POST", f"/v1/sessions/{sid}/restore",
                                content=got[2])
                log["restored"] += 1
            await asyncio.sleep(rng.uniform(0.0, 0.5))
        await self.request("golden", "DELETE", f"/v1/sessions/{sid}", {200})

    async def golden_turn(self, body: dict, stream: bool):
        """(tokens, log-probs) of one turn, or what went wrong; a full queue is waited out."""
        for _ in range(50):
            if stream:
                out = await self.stream("golden", {**body, "stream": True})
                if out["status"] != BUSY:
                    return (out["tokens"], out["logprobs"]) if out["status"] == OK and out["done"] else \
                        f"streamed: status {out['status']}, done {out['done']}, error {out['error']}"
            else:
                got = await self.request("golden", "POST", "/v1/completions", ANSWERED, json_body=body)
                if got and got[0] == OK:
                    choice = got[1]["choices"][0]
                    return choice["token_ids"], choice["logprobs"]["token_logprobs"]
                if not got or got[0] != BUSY:
                    return f"status {got and got[0]}"
            await asyncio.sleep(0.2)
        return "the queue stayed full for 10 s"

    def check_golden(self):
        for log in self.golden_log:
            if log["error"]:
                self.fail("golden", f"{log['id']}: {log['error']}")
                continue
            for turn, ((toks, lps), (want_toks, want_lps)) in enumerate(zip(log["got"], self.reference(log["segments"]))):
                if list(toks) != list(want_toks):
                    self.fail("golden", f"{log['id']} turn {turn}: tokens {toks} != one stream's {list(want_toks)}")
                elif not np.allclose(lps, want_lps, rtol=0, atol=self.s.logprob_atol):
                    worst = float(np.max(np.abs(np.subtract(lps, want_lps))))
                    self.fail("golden", f"{log['id']} turn {turn}: log-probs differ from one stream's by {worst:.2e}")

    # -- phases ---------------------------------------------------------------------------------------------------
    async def worker(self, w: int, until: float, golden: bool):
        for n in itertools.count():
            if self.stop.is_set() or time.monotonic() >= until or self.ops >= self.s.max_ops:
                return
            self.ops += 1
            rng = random.Random(f"{self.s.seed}-{w}-{n}-{golden}")  # the warm-up's and the chaos's own sequences
            name = rng.choices(list(MIX), weights=list(MIX.values()))[0]
            self.op_counts[name] += 1
            await self.guarded(getattr(self, f"op_{name}")(rng), name, self.s.timeout_s + 5)

    async def phase(self, seconds: float, golden: bool):
        until = time.monotonic() + seconds
        # idle pooled connections are dropped before uvicorn's 5 s keep-alive would close them under a request
        limits = httpx.Limits(max_connections=4 * self.s.workers + 2 * self.t.max_batch, keepalive_expiry=2.0)
        async with httpx.AsyncClient(base_url=self.t.url, timeout=self.s.timeout_s, limits=limits,
                                     headers=self.auth) as self.client:
            await asyncio.gather(*(self.worker(w, until, golden) for w in range(self.s.workers)),
                                 *(self.guarded(self.golden(k, until), "golden") for k in range(self.s.golden if golden else 0)))

    async def fewest_fds(self, at_most: int, seconds: float) -> int:
        """The fewest descriptors seen until there are at most `at_most`, or `seconds` passed (closed connections
        only ever go away)."""
        fewest, end = len(open_fds(self.t.pid)), time.monotonic() + seconds
        while fewest > at_most and time.monotonic() < end:
            await asyncio.sleep(0.1)
            fewest = min(fewest, len(open_fds(self.t.pid)))
        return fewest

    async def sample_rss(self):
        while True:
            self.rss_samples.append((time.monotonic(), rss_bytes(self.t.pid)))
            await asyncio.sleep(1.0)

    async def idle(self) -> bool:
        """Wait (settle_s at most, a few seconds after a hang) until nothing runs or waits; False if it never did."""
        end = time.monotonic() + (5.0 if self.stop.is_set() else self.s.settle_s)
        async with self.client_for_one() as client:
            while time.monotonic() < end:
                try:
                    text = (await client.get("/metrics")).text
                except httpx.TransportError:
                    text = ""
                if metric_value(text, "txl_running_streams") == 0 and metric_value(text, "txl_queue_depth") == 0:
                    return True
                await asyncio.sleep(0.1)
        return False

    async def fill_rows(self, label: str) -> list[str]:
        """The capacity probe: every row in use at once, `max_sessions` sessions holding memory and `max_batch`
        streams generating together (each has a token while none has finished); then all of it let go."""
        problems, everyone, firsts = [], asyncio.Event(), [asyncio.Event() for _ in range(self.t.max_batch)]
        ids = [f"probe-{label}-{i}" for i in range(self.t.max_sessions)]
        async with httpx.AsyncClient(base_url=self.t.url, timeout=self.s.timeout_s, headers=self.auth,
                                     limits=httpx.Limits(max_connections=self.t.max_batch + 4)) as client:
            for sid in ids:  # one after another: each new session may evict a leftover, never one of these
                got = await self.request("probe", "POST", "/v1/sessions", {201}, json_body={"id": sid}, client=client)
                if got and got[0] == 201:
                    got = await self.request("probe", "POST", "/v1/completions", {200}, client=client,
                                             json_body={"prompt": [1, 2, 3], "max_tokens": 0, "session_id": sid})
                if not got or got[0] not in (200, 201):
                    problems.append(f"session {sid} could not take a row: {got and got[0]}")

            async def one_stream(i):
                body = {"prompt": [1 + i % 7], "max_tokens": min(self.t.max_tokens, 2000), "temperature": 0.8,
                        "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != OK:
                        self.answer("probe", "stream", r.status_code, await r.aread(), {200})
                        return problems.append(f"stream {i}: {r.status_code}")
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            firsts[i].set()
                            if all(f.is_set() for f in firsts):
                                everyone.set()
                        elif line.startswith("data: [DONE]"):  # finished before every stream had started
                            return logger.info("probe: stream %d finished before the last one started", i)
                        if everyone.is_set():
                            return

            try:
                await asyncio.wait_for(asyncio.gather(*map(one_stream, range(self.t.max_batch))), self.s.timeout_s)
            except asyncio.TimeoutError:
                self.fail("hangs", f"capacity probe: {sum(f.is_set() for f in firsts)} of {self.t.max_batch} streams "
                                   f"got a token within {self.s.timeout_s:g} s with every session holding its row")
                self.stop.set()
            except httpx.TransportError as e:
                problems.append(f"a stream broke off: {type(e).__name__}: {e}")
            for sid in ids:
                await self.request("probe", "DELETE", f"/v1/sessions/{sid}", {200}, client=client)
        return problems

    async def idle_state(self, when: str) -> dict:
        """Rows, descriptors and memory of the idle server, each problem failed under `rows`."""
        out = {"idle": await self.idle()}
        if not out["idle"]:
            self.fail("rows", f"{when}: the server did not become idle within {self.s.settle_s:g} s")
        async with self.client_for_one() as client:
            try:
                text = (await client.get("/metrics")).text
                listed = (await client.get("/v1/sessions", headers=self.auth)).json()["data"]
                g = out["gauges"] = {"running": metric_value(text, "txl_running_streams"),
                                     "queued": metric_value(text, "txl_queue_depth"),
                                     "sessions": metric_value(text, "txl_sessions"), "listed_sessions": len(listed)}
                out["labels"] = sorted(set(re.findall(  # the request counter's endpoint labels
                    r'^txl_requests_total\{[^}\n]*endpoint="((?:[^"\\]|\\.)*)"', text, re.MULTILINE)))
                out["health"] = (await client.get("/health")).status_code
                if g["sessions"] != g["listed_sessions"]:
                    self.fail("rows", f"{when}: txl_sessions says {g['sessions']}, GET /v1/sessions lists "
                                      f"{g['listed_sessions']}")
                if out["health"] != 200:
                    self.fail("rows", f"{when}: /health answers {out['health']}")
            except (httpx.TransportError, ValueError, KeyError) as e:
                out["metrics_error"] = f"{type(e).__name__}: {e}"
                self.fail("rows", f"{when}: no metrics ({out['metrics_error']})")
        out["fds"], out["rss"] = len(open_fds(self.t.pid)), rss_bytes(self.t.pid)
        logger.info("%s: idle %s, %d fds, RSS %.1f MiB", when, out["idle"], out["fds"], out["rss"] / 2**20)
        return out

    async def run(self) -> dict:
        started = self.started = time.monotonic()
        async with self.client_for_one() as client:  # the model's size, and a parked state of it for restores
            info = (await client.get("/v1/models", headers=self.auth)).json()["data"][0]
            self.n_token, self.session_bytes = int(info["n_token"]), int(info["session_memory_bytes"] or 0)
            await client.post("/v1/sessions", json={"id": "chaos-seed"}, headers=self.auth)
            r = await client.post("/v1/completions", headers=self.auth, json={
                "prompt": [i % self.n_token for i in range(40)], "max_tokens": 5, "session_id": "chaos-seed"})
            if r.status_code != OK:
                raise RuntimeError(f"the server did not answer a plain session request: {r.status_code} {r.text}")
            self.blob = (await client.post("/v1/sessions/chaos-seed/park", headers=self.auth)).content
        sampler = asyncio.create_task(self.sample_rss())
        try:
            logger.info("warm-up: %g s of the mix, then every row at once", self.s.warmup_s)
            await self.phase(self.s.warmup_s, golden=False)
            warm_probe = await self.guarded(self.fill_rows("warm"), "probe", prefix="capacity probe: ") or []
            before = await self.idle_state("after the warm-up")
            before["fds"] = await self.fewest_fds(0, 1.0)
            before["fd_kinds"] = fd_kinds(self.t.pid)
            baseline_at = time.monotonic()
            if not self.stop.is_set():
                logger.info("chaos: %g s, %d workers, %d golden sessions", self.s.duration_s, self.s.workers,
                            self.s.golden)
                await self.phase(self.s.duration_s, golden=True)
            chaos_s = time.monotonic() - baseline_at
            after = await self.idle_state("after the chaos")
            probe = ["skipped: the server hung"] if self.failures["hangs"] else \
                await self.guarded(self.fill_rows("end"), "probe", prefix="capacity probe: ") or []
            for p in probe:
                self.fail("rows", f"capacity probe: {p}")
            for p in warm_probe:
                self.fail("rows", f"capacity probe after the warm-up: {p}")
            end = await self.idle_state("after the probe")
            end["fds"] = await self.fewest_fds(before["fds"] + self.s.fd_slack, self.s.settle_s)
            end["rss"] = rss_bytes(self.t.pid)
        finally:
            sampler.cancel()
        end["fd_kinds"] = fd_kinds(self.t.pid)
        if end["fds"] > before["fds"] + self.s.fd_slack:
            more = Counter(end["fd_kinds"]) - Counter(before["fd_kinds"])
            self.fail("fds", f"{end['fds']} file descriptors open once idle, {before['fds']} after the warm-up "
                             f"(slack {self.s.fd_slack}); more than then: {dict(more.most_common(8))}")
        allowed = before["rss"] * (1 + self.s.rss_slack_frac) + self.s.rss_slack_mib * 2**20
        if end["rss"] > allowed:
            self.fail("rss", f"resident memory {end['rss'] / 2**20:.1f} MiB once idle, {before['rss'] / 2**20:.1f} "
                             f"MiB after the warm-up (allowed {allowed / 2**20:.1f} MiB)")
        labels = end.get("labels") or []
        junk = [lb for lb in labels if JUNK in lb]
        if junk or len(labels) > len(ROUTES) + 1:
            self.fail("labels", f"{len(labels)} endpoint labels (the routes allow {len(ROUTES) + 1}), "
                                f"{len(junk)} made from paths clients sent, e.g. {junk[:3]}")
        await asyncio.to_thread(self.check_golden)
        return {
            "settings": asdict(self.s), "target": asdict(self.t),
            "seconds": {"total": time.monotonic() - started, "chaos": chaos_s},
            "operations": self.ops, "requests": sum(sum(c.values()) for c in self.counts.values()),
            "mix": dict(sorted(self.op_counts.items())),
            "answers": {op: dict(sorted(c.items())) for op, c in sorted(self.counts.items())},
            "before": before, "after": after, "end": end,
            "rss_samples_mib": [round(b / 2**20, 1) for _, b in self.rss_samples],
            "rss_after_warmup_mib": [round(b / 2**20, 1) for t, b in self.rss_samples if t >= baseline_at],
            "golden": [{"id": g["id"], "turns": len(g["got"]), "restored": g["restored"],
                        "tokens": sum(len(t) for t, _ in g["got"]), "error": g["error"]} for g in self.golden_log],
            "failures": self.failures, "failure_counts": {c: self.failure_counts[c] for c in CRITERIA},
        }


def run_chaos(target: Target, settings: ChaosSettings | None = None, reference: Callable | None = None) -> dict:
    """The whole run against `target` (warm-up, chaos, the checks); the report as a dict (JSON-ready).
    `reference(segments)` -> per segment (tokens, log-prob of each): what one in-process stream gives for the
    golden sessions' segments, each (prompt ids, n greedy tokens); without one, no golden sessions run."""
    settings = settings or ChaosSettings()
    return asyncio.run(_Chaos(target, settings if reference else replace(settings, golden=0), reference).run())


# -- the results file (benchmarks/results_chaos.md) ---------------------------------------------------------------
def markdown(report: dict, about: dict) -> str:
    """The report for people. `about`: label (the model), server (how it ran), machine, versions, date, and
    optionally exit (the server's exit status on SIGTERM) and log_errors (error lines in its log)."""
    s, t, sec, before, end = report["settings"], report["target"], report["seconds"], report["before"], report["end"]
    samples, golden, labels = report["rss_after_warmup_mib"] or report["rss_samples_mib"], report["golden"], \
        end.get("labels") or []
    lines = [
        (f"Model: {about['label']}, served by {about['server']} with --max-batch {t['max_batch']}, --max-sessions "
         f"{t['max_sessions']}, an API key. {s['workers']} workers for {s['duration_s']:g} s after a "
         f"{s['warmup_s']:g} s warm-up of the same mix, {s['golden']} golden conversations at a time, seed "
         f"{s['seed']}, every operation bounded by {s['timeout_s']:g} s."), "",
        *harness.table(["criterion", "held", "failures"],
                       [[CRITERIA[c], "**NO**" if report["failure_counts"][c] else "yes", report["failure_counts"][c]]
                        for c in CRITERIA], numeric_from=2), "",
        (f"{report['operations']} operations, {report['requests']} answers in {sec['total']:.0f} s "
         f"({report['requests'] / sec['total']:.0f} answers/s). Golden: {len(golden)} conversations, "
         f"{sum(g['turns'] for g in golden)} turns, {sum(g['tokens'] for g in golden)} tokens, "
         f"{sum(g['restored'] for g in golden)} park+restore in between, each turn equal to one stream."),
        (f"Resident memory {before['rss'] / 2**20:.0f} MiB after the warm-up, {end['rss'] / 2**20:.0f} MiB once idle "
         f"at the end (allowed {s['rss_slack_frac']:.0%} + {s['rss_slack_mib']:g} MiB more; sampled each second "
         f"after the warm-up: {min(samples):.0f} to {max(samples):.0f} MiB). File descriptors {before['fds']} after "
         f"the warm-up, {end['fds']} once idle. Endpoint labels: {len(labels)} ({', '.join(labels)})."),
    ]
    if "exit" in about:
        lines.append(f"On SIGTERM at the end the server exited with status {about['exit']}; its log has "
                     f"{about.get('log_errors', 0)} error lines.")
    lines += ["", *harness.table(["operation", "runs", "answers by status"], [
        [op, n, ", ".join(f"{k}: {v}" for k, v in report["answers"].get(op, {}).items()) or "(raw connection)"]
        for op, n in report["mix"].items()])]
    for c in (c for c in CRITERIA if report["failures"][c]):
        lines += ["", f"Failures, {c} (first {len(report['failures'][c])} of {report['failure_counts'][c]}):", "",
                  *(f"- {m}" for m in report["failures"][c])]
    return "\n".join([*lines, "", measured_line(about["date"], about["machine"], about["versions"])]) + "\n"


def measure(args, command):
    """The server up, the chaos against it, the server stopped; the results file and its JSON."""
    if args.max_sessions < 2 * (args.workers + args.golden):
        raise InputError("--max-sessions must be at least 2 x (--workers + --golden): the golden sessions must never "
                         "be the least recently used one evicted")
    key = secrets.token_hex(12)
    settings = ChaosSettings(duration_s=args.duration, warmup_s=args.warmup, workers=args.workers, seed=args.seed,
                             golden=args.golden, timeout_s=args.timeout, hold_s=3.0)
    with tempfile.TemporaryDirectory(prefix="txl-serve-chaos-") as tmp:
        model_file, label = prepare_model(args.model, Path(tmp), cache_dir=args.cache_dir)
        reference = runtime_reference(lambda: TxlRuntime.load(model_file, providers=["cpu"], threads=args.threads))
        about = {"label": label, "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "machine": machine(), "versions": versions(),
                 "server": f"`txl-deploy serve` in its own process ({args.threads} ONNX Runtime thread(s))"}
        srv = ServeProcess([str(model_file), f"--threads={args.threads}", f"--max-batch={args.max_batch}",
                            f"--max-sessions={args.max_sessions}", f"--max-queue={4 * args.max_batch}",
                            f"--max-prompt-tokens={MAX_PROMPT}", "--api-key", key], Path(tmp) / "serve.log")
        try:
            target = Target(srv.wait_ready().url, srv.proc.pid, args.max_batch, args.max_sessions,
                            max_prompt_tokens=MAX_PROMPT, api_key=key)
            report = run_chaos(target, settings, reference)
        finally:
            about["exit"] = srv.close()
        about["log_errors"] = sum(("ERROR" in ln or "Traceback" in ln)
                                  for ln in srv.log_path.read_text(errors="replace").splitlines())
    text = harness.results_markdown("HTTP serving under chaos: faults from the clients, what holds after",
                                    markdown(report, about), command)
    return text, {"report": report, "about": about, "command": command}, 1 if any(report["failures"].values()) else 0


def main(argv=None) -> int:
    p = harness.parser("serve_chaos", __doc__, md="results_chaos.md")
    p.add_argument("--model", help="an .onnx file or a checkpoint (exported first); default: the bundled demo model")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of chaos after the warm-up")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of the same mix before the baselines")
    p.add_argument("--workers", type=int, default=8, help="operations at once")
    p.add_argument("--golden", type=int, default=3, help="golden conversations at once")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one operation may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-sessions", type=int, default=32)
    return harness.main("serve_chaos", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
