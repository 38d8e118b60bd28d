"""Chaos against `txl-deploy serve`: minutes of mixed load and client-side faults over loopback (`chaos_mix`), then
what must hold once the server is idle again, one list of failures per criterion (`CRITERIA`: no 5xx, no hang,
only documented answers, rows free or held once, file descriptors and resident memory back near their size after
the warm-up, golden sessions equal to one in-process stream, bounded metric labels). Method and figures:
docs/benchmarks.md ("Serving"); the suite runs a one-minute version (tests/serving/http/test_serve_chaos.py)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import httpx
import numpy as np

from benchmarks import harness
from benchmarks.chaos_mix import (
    ANSWERED,
    BUSY,
    CRITERIA,
    JUNK,
    MIX,
    OK,
    ChaosClient,
    ChaosSettings,
    Hang,
    Target,
)
from benchmarks.serve_load import ServeProcess
from benchmarks.serving_load import machine, measured_line, prepare_model, versions
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.http.protocol import ApiError

logger = logging.getLogger(__name__)

# The server's routes: the endpoint label set may hold these and one label for every other path.
ROUTES = ("/v1/completions", "/v1/models", "/v1/sessions", "/v1/sessions/{id}", "/v1/sessions/{id}/park",
          "/v1/sessions/{id}/restore", "/health", "/metrics")


# -- what the server's process holds ----------------------------------------------------------------------------
def open_fds(pid: int) -> list[str]:
    """What the process's file descriptors point at (sockets, files, pipes)."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed in between
            pass
    return out


def fd_kinds(pid: int) -> Counter:
    """Open descriptors by kind: socket, pipe, anon_inode:[eventfd], or the file's path."""
    return Counter(re.sub(r"^(socket|pipe):\[\d+\]$", r"\1", t) for t in open_fds(pid))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"no VmRSS for process {pid}")


def engine_rows(engine, timeout: float = 30.0) -> dict | None:
    """The in-process engine's rows, counted in its own thread between two steps: the pool's size, its free rows
    (and how many distinct), the live sessions and the rows they hold; None when rows are not one pool."""
    def count():
        rows = engine.rows
        if not hasattr(rows, "free"):
            return None
        free = [int(r) for r in rows.free]
        held = []
        ids = engine.sessions.all_ids()
        for id_ in ids:
            try:
                session = engine.sessions.get(id_)
            except ApiError:  # gone in between
                continue
            if session.handle is not None:
                held.append(int(session.handle))
        return {"size": engine.max_batch + engine.sessions.max_sessions, "free": len(free),
                "free_distinct": len(set(free)), "sessions": len(ids), "session_rows": len(held),
                "session_rows_distinct": len(set(held)), "free_and_held": len(set(free) & set(held)),
                "running": engine.running, "queued": engine.queue_depth}
    return engine.call(count).result(timeout)


def row_problems(rows: dict) -> list[str]:
    out = []
    if rows["running"] or rows["queued"]:
        out.append(f"{rows['running']} requests running and {rows['queued']} queued on an idle server")
    if rows["free_distinct"] != rows["free"]:
        out.append(f"{rows['free'] - rows['free_distinct']} rows are free twice")
    if rows["session_rows_distinct"] != rows["session_rows"] or rows["free_and_held"]:
        out.append(f"rows shared: {rows['session_rows'] - rows['session_rows_distinct']} between sessions, "
                   f"{rows['free_and_held']} both free and a session's")
    if rows["free_distinct"] + rows["session_rows_distinct"] != rows["size"]:
        lost = rows["size"] - rows["free_distinct"] - rows["session_rows_distinct"]
        out.append(f"{lost} of {rows['size']} rows are neither free nor held by a live session "
                   f"(free {rows['free_distinct']}, held by the {rows['sessions']} live sessions "
                   f"{rows['session_rows_distinct']})")
    return out


def metric_value(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def endpoint_labels(text: str) -> set[str]:
    """The endpoint label values of the request counter in a /metrics page."""
    return set(re.findall(r'^txl_requests_total\{[^}\n]*endpoint="((?:[^"\\]|\\.)*)"', text, re.MULTILINE))


# -- the run ----------------------------------------------------------------------------------------------------


# -- the run -----------------------------------------------------------------------------------------------------
class _Chaos(ChaosClient):
    """The run: the warm-up and the chaos (workers and golden conversations), the capacity probe, the checks."""

    def __init__(self, target: Target, settings: ChaosSettings, reference):
        super().__init__(target, settings)
        self.reference = reference
        self.ops = 0
        self.op_counts = Counter()
        self.stop = asyncio.Event()
        self.rss_samples: list[tuple[float, int]] = []
        self.golden_log: list[dict] = []

    # -- golden sessions -------------------------------------------------------------------------------------------
    async def golden(self, k: int, until: float):
        """Golden conversations one after another until `until`: each `golden_turns` turns, some parked and
        restored under a new id between turns; their segments and what the server answered go to golden_log,
        checked against the reference after the run."""
        for j in itertools.count():
            if self.stop.is_set() or time.monotonic() >= until:
                return
            rng = random.Random(f"golden-{self.s.seed}-{k}-{j}")
            log = {"id": f"golden-{k}-{j}", "segments": [], "got": [], "restored": 0, "error": None}
            self.golden_log.append(log)
            await self.golden_conversation(rng, log)

    async def golden_conversation(self, rng: random.Random, log: dict):
        sid = f"{log['id']}-0"
        got = await self.request("golden", "POST", "/v1/sessions", {201}, json_body={"id": sid})
        if not got or got[0] != 201:
            log["error"] = f"could not create {sid}: {got and got[0]}"
            return
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
                log["error"] = f"turn {turn} on {sid}: {answer}"
                return
            log["segments"].append((prompt, n))
            log["got"].append(answer)
            if rng.random() < 0.4:
                r = await self.client.post(f"/v1/sessions/{sid}/park", headers=self.headers())
                if r.status_code != OK:
                    self.answer("golden", "POST /v1/sessions/ID/park", r.status_code, r.content, {200})
                    log["error"] = f"park of {sid} after turn {turn}: {r.status_code}"
                    return
                sid = f"{log['id']}-{turn + 1}"
                got = await self.request("golden", "POST", f"/v1/sessions/{sid}/restore", {201}, content=r.content)
                if not got or got[0] != 201:
                    log["error"] = f"restore as {sid} after turn {turn}: {got and got[0]}"
                    return
                log["restored"] += 1
            await asyncio.sleep(rng.uniform(0.0, 0.5))
        await self.request("golden", "DELETE", f"/v1/sessions/{sid}", {200})

    async def golden_turn(self, body: dict, stream: bool):
        """(tokens, log-probs) of one turn, or what went wrong; a full queue is waited out."""
        for _ in range(50):
            if stream:
                out = await self.stream("golden", {**body, "stream": True})
                if out["status"] == BUSY:
                    await asyncio.sleep(0.2)
                    continue
                if out["status"] != OK or not out["done"]:
                    return f"streamed: status {out['status']}, done {out['done']}, error {out['error']}"
                return out["tokens"], out["logprobs"]
            got = await self.request("golden", "POST", "/v1/completions", ANSWERED, json_body=body)
            if got and got[0] == BUSY:
                await asyncio.sleep(0.2)
                continue
            if not got or got[0] != OK:
                return f"status {got and got[0]}"
            choice = got[1]["choices"][0]
            return choice["token_ids"], choice["logprobs"]["token_logprobs"]
        return "the queue stayed full for 10 s"

    def check_golden(self):
        for log in self.golden_log:
            if log["error"]:
                self.fail("golden", f"{log['id']}: {log['error']}")
                continue
            want = self.reference(log["segments"])
            for turn, ((toks, lps), (want_toks, want_lps)) in enumerate(zip(log["got"], want)):
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
            await self.bounded(name, getattr(self, f"op_{name}")(rng))

    async def bounded(self, name: str, coro):
        try:
            await asyncio.wait_for(coro, self.s.timeout_s + 5)
        except (Hang, asyncio.TimeoutError) as e:
            self.fail("hangs", str(e) or f"{name}: not done within {self.s.timeout_s + 5:g} s")
            self.stop.set()  # a server that stopped answering: the rest would only wait as long

    async def golden_bounded(self, k: int, until: float):
        try:
            await self.golden(k, until)
        except Hang as e:
            self.fail("hangs", str(e))
            self.stop.set()

    async def fewest_fds(self, now: int) -> int:
        """The settled descriptor count: the fewest seen over a second (closed connections only ever go away)."""
        fewest = now
        for _ in range(10):
            await asyncio.sleep(0.1)
            fewest = min(fewest, len(open_fds(self.t.pid)))
        return fewest

    async def sample_rss(self):
        while True:
            self.rss_samples.append((time.monotonic(), rss_bytes(self.t.pid)))
            await asyncio.sleep(1.0)

    def new_client(self) -> httpx.AsyncClient:
        # idle pooled connections are dropped before uvicorn's 5 s keep-alive would close them under a request
        limits = httpx.Limits(max_connections=4 * self.s.workers + 2 * self.t.max_batch, keepalive_expiry=2.0)
        return httpx.AsyncClient(base_url=self.t.url, timeout=self.s.timeout_s, limits=limits, headers=self.auth)

    async def phase(self, seconds: float, golden: bool):
        until = time.monotonic() + seconds
        async with self.new_client() as self.client:
            tasks = [self.worker(w, until, golden) for w in range(self.s.workers)]
            if golden:
                tasks += [self.golden_bounded(k, until) for k in range(self.s.golden)]
            await asyncio.gather(*tasks)

    async def idle(self) -> bool:
        """Wait (settle_s at most, a few seconds after a hang) until nothing runs or waits; False if it never
        happened."""
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

    async def probe(self, label: str) -> list[str]:
        """The capacity probe (`fill_rows`); a request of it that got no answer is a hang, and ends the run."""
        try:
            return await self.fill_rows(label)
        except Hang as e:
            self.fail("hangs", f"capacity probe: {e}")
            self.stop.set()
            return []

    async def fill_rows(self, label: str) -> list[str]:
        """Every row in use at once: `max_sessions` sessions holding memory and `max_batch` streams generating
        together (each has a token while none has finished); then all of it let go."""
        problems = []
        ids = [f"probe-{label}-{i}" for i in range(self.t.max_sessions)]
        limits = httpx.Limits(max_connections=self.t.max_batch + 4)
        async with httpx.AsyncClient(base_url=self.t.url, timeout=self.s.timeout_s, limits=limits,
                                     headers=self.auth) as client:
            async def one_session(sid):
                got = await self.request("probe", "POST", "/v1/sessions", {201}, json_body={"id": sid}, client=client)
                if got and got[0] == 201:
                    got = await self.request("probe", "POST", "/v1/completions", {200}, client=client,
                                             json_body={"prompt": [1, 2, 3], "max_tokens": 0, "session_id": sid})
                if not got or got[0] not in (200, 201):
                    problems.append(f"session {sid} could not take a row: {got and got[0]}")

            for sid in ids:  # one after another: each new session may evict a leftover, never one of these
                await one_session(sid)
            everyone = asyncio.Event()
            firsts = [asyncio.Event() for _ in range(self.t.max_batch)]
            overlap = []

            async def one_stream(i):
                body = {"prompt": [1 + i % 7], "max_tokens": min(self.t.max_tokens, 2000), "temperature": 0.8,
                        "stream": True}
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != OK:
                        self.answer("probe", "stream", r.status_code, await r.aread(), {200})
                        problems.append(f"stream {i}: {r.status_code}")
                        return
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            firsts[i].set()
                            if all(f.is_set() for f in firsts):
                                everyone.set()
                        elif line.startswith("data: [DONE]"):
                            overlap.append(i)  # finished before every stream had started: not all at once
                            return
                        if everyone.is_set():
                            return

            try:
                await asyncio.wait_for(asyncio.gather(*(one_stream(i) for i in range(self.t.max_batch))),
                                       self.s.timeout_s)
            except asyncio.TimeoutError:
                self.fail("hangs", f"capacity probe: {sum(f.is_set() for f in firsts)} of {self.t.max_batch} streams "
                                   f"got a token within {self.s.timeout_s:g} s with every session holding its row")
                self.stop.set()
            except httpx.TransportError as e:
                problems.append(f"a stream broke off: {type(e).__name__}: {e}")
            if overlap and not everyone.is_set():
                logger.info("probe: %d streams finished before the last one started", len(overlap))
            for sid in ids:
                await self.request("probe", "DELETE", f"/v1/sessions/{sid}", {200}, client=client)
        return problems

    async def measure(self, label: str) -> dict:
        """Rows, descriptors and memory of the idle server."""
        out = {"idle": await self.idle()}
        if self.t.engine is not None:
            try:
                out["rows"] = await asyncio.to_thread(engine_rows, self.t.engine, self.s.settle_s)
            except Exception as e:  # noqa: BLE001 - an engine that cannot be asked is itself the finding
                out["rows"] = None
                out["rows_error"] = f"{type(e).__name__}: {e}"
        async with self.client_for_one() as client:
            try:
                text = (await client.get("/metrics")).text
                listed = (await client.get("/v1/sessions", headers=self.auth)).json()["data"]
                out["gauges"] = {"running": metric_value(text, "txl_running_streams"),
                                 "queued": metric_value(text, "txl_queue_depth"),
                                 "sessions": metric_value(text, "txl_sessions"), "listed_sessions": len(listed)}
                out["labels"] = sorted(endpoint_labels(text))
                out["health"] = (await client.get("/health")).status_code
            except (httpx.TransportError, ValueError, KeyError) as e:
                out["metrics_error"] = f"{type(e).__name__}: {e}"
        out["fds"] = len(open_fds(self.t.pid))
        out["rss"] = rss_bytes(self.t.pid)
        logger.info("%s: idle %s, %d fds, RSS %.1f MiB, rows %s", label, out["idle"], out["fds"],
                    out["rss"] / 2**20, out.get("rows"))
        return out

    async def settled_fds(self, at_most: int) -> int:
        """The fd count once it is at most `at_most`, or the last seen after settle_s."""
        end = time.monotonic() + self.s.settle_s
        while True:
            n = len(open_fds(self.t.pid))
            if n <= at_most or time.monotonic() >= end:
                return n
            await asyncio.sleep(0.2)

    def check_idle(self, m: dict, when: str):
        if not m["idle"]:
            self.fail("rows", f"{when}: the server did not become idle within {self.s.settle_s:g} s")
        if "rows_error" in m:
            self.fail("rows", f"{when}: the engine could not count its rows: {m['rows_error']}")
        elif m.get("rows"):
            for p in row_problems(m["rows"]):
                self.fail("rows", f"{when}: {p}")
        if m.get("health", 200) != 200:
            self.fail("rows", f"{when}: /health answers {m['health']}")
        g = m.get("gauges")
        if g is None:
            self.fail("rows", f"{when}: no metrics ({m.get('metrics_error')})")
        elif g["sessions"] != g["listed_sessions"]:
            self.fail("rows", f"{when}: txl_sessions says {g['sessions']}, GET /v1/sessions lists "
                              f"{g['listed_sessions']}")

    async def run(self) -> dict:
        started = self.started = time.monotonic()
        async with self.client_for_one() as client:
            info = (await client.get("/v1/models", headers=self.auth)).json()["data"][0]
            self.n_token, self.session_bytes = int(info["n_token"]), int(info["session_memory_bytes"] or 0)
            sid = "chaos-seed"
            await client.post("/v1/sessions", json={"id": sid}, headers=self.auth)
            r = await client.post("/v1/completions", headers=self.auth, json={
                "prompt": [i % self.n_token for i in range(40)], "max_tokens": 5, "session_id": sid})
            if r.status_code != OK:
                raise RuntimeError(f"the server did not answer a plain session request: {r.status_code} {r.text}")
            self.blob = (await client.post(f"/v1/sessions/{sid}/park", headers=self.auth)).content
        sampler = asyncio.create_task(self.sample_rss())
        try:
            logger.info("warm-up: %g s of the mix, then every row at once", self.s.warmup_s)
            await self.phase(self.s.warmup_s, golden=False)
            warm_probe = await self.probe("warm")
            before = await self.measure("after the warm-up")
            self.check_idle(before, "after the warm-up")
            before["fds"] = await self.fewest_fds(before["fds"])
            before["fd_kinds"] = dict(fd_kinds(self.t.pid))
            baseline_at = time.monotonic()
            if not self.stop.is_set():
                logger.info("chaos: %g s, %d workers, %d golden sessions", self.s.duration_s, self.s.workers,
                            self.s.golden)
                await self.phase(self.s.duration_s, golden=True)
            chaos_s = time.monotonic() - baseline_at
            after = await self.measure("after the chaos")
            self.check_idle(after, "after the chaos")
            probe = await self.probe("end") if not self.failures["hangs"] else ["skipped: the server hung"]
            for p in probe:
                self.fail("rows", f"capacity probe: {p}")
            for p in warm_probe:
                self.fail("rows", f"capacity probe after the warm-up: {p}")
            end = await self.measure("after the probe")
            self.check_idle(end, "after the probe")
            end["fds"] = await self.settled_fds(before["fds"] + self.s.fd_slack)
            end["rss"] = rss_bytes(self.t.pid)
        finally:
            sampler.cancel()
        end["fd_kinds"] = dict(fd_kinds(self.t.pid))
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
        requests = sum(sum(c.values()) for c in self.counts.values())
        return {
            "settings": asdict(self.s), "target": {k: getattr(self.t, k) for k in Target.__dataclass_fields__ if k != "engine"},
            "seconds": {"total": time.monotonic() - started, "chaos": chaos_s},
            "operations": self.ops, "requests": requests, "mix": dict(sorted(self.op_counts.items())),
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
    golden sessions' segments, each (prompt ids, n greedy tokens); see `runtime_reference`. Without one, no golden
    sessions run."""
    settings = settings or ChaosSettings()
    if reference is None:
        settings = ChaosSettings(**{**asdict(settings), "golden": 0})
    return asyncio.run(_Chaos(target, settings, reference).run())


def runtime_reference(make_runtime: Callable) -> Callable:
    """The golden sessions' reference on a fresh runtime from `make_runtime()` per conversation: each segment feeds
    its prompt (if any), then n greedy tokens, each fed too, as a session's turn does."""
    def reference(segments):
        rt = make_runtime()
        try:
            out, lp = [], None
            for prompt, n in segments:
                if len(prompt):
                    lp = rt.prefill(np.asarray(prompt, dtype=np.int64)[None])[0]
                toks, lps = [], []
                for _ in range(n):
                    toks.append(int(np.argmax(lp)))
                    lps.append(float(lp[toks[-1]]))
                    lp = rt.prefill(np.array([[toks[-1]]], dtype=np.int64))[0]
                out.append((toks, lps))
            return out
        finally:
            rt.close()
    return reference


def passed(report: dict) -> bool:
    return not any(report["failures"].values())


def summary(report: dict) -> str:
    """A few lines for people: what ran, and every criterion that failed with its first messages."""
    lines = [f"{report['operations']} operations, {report['requests']} answers in {report['seconds']['total']:.0f} s"]
    for c in CRITERIA:
        if report["failures"][c]:
            lines.append(f"{c}: {report['failure_counts'][c]} failures, e.g.")
            lines += [f"  - {m}" for m in report["failures"][c][:5]]
    return "\n".join(lines)



# -- the results file (benchmarks/results_chaos.md) ---------------------------------------------------------------
WHAT = {
    "server_errors": "no 5xx but a documented 503 (loading, draining)",
    "hangs": "every request answered within the timeout, streams included",
    "answers": "every answer one the API documents for what was sent",
    "rows": "idle: every row free or one live session's; all usable at once",
    "fds": "file descriptors back to their count after the warm-up",
    "rss": "resident memory flat after the warm-up",
    "golden": "golden sessions equal one in-process stream",
    "labels": "endpoint labels bounded by the routes",
}


def markdown(report: dict, about: dict) -> str:
    """The report for people. `about`: label (the model), server (how it ran), machine, versions, date, and
    optionally exit (the server's exit status on SIGTERM) and log_errors (error lines in its log)."""
    s, t, sec = report["settings"], report["target"], report["seconds"]
    before, end = report["before"], report["end"]
    mib = 2 ** 20
    samples = report["rss_after_warmup_mib"] or report["rss_samples_mib"]
    lines = [
        (f"Model: {about['label']}, served by {about['server']} with --max-batch {t['max_batch']}, --max-sessions "
         f"{t['max_sessions']}, an API key. {s['workers']} workers for {s['duration_s']:g} s after a "
         f"{s['warmup_s']:g} s warm-up of the same mix, {s['golden']} golden conversations at a time, seed "
         f"{s['seed']}, every operation bounded by {s['timeout_s']:g} s."),
        "",
        *harness.table(["criterion", "held", "failures"],
                       [[WHAT[c], "**NO**" if report["failure_counts"][c] else "yes", report["failure_counts"][c]]
                        for c in CRITERIA], numeric_from=2),
    ]
    golden = report["golden"]
    rows = (end.get("rows") or {})
    lines += [
        "",
        (f"{report['operations']} operations, {report['requests']} answers in {sec['total']:.0f} s "
         f"({report['requests'] / sec['total']:.0f} answers/s). Golden: {len(golden)} conversations, "
         f"{sum(g['turns'] for g in golden)} turns, {sum(g['tokens'] for g in golden)} tokens, "
         f"{sum(g['restored'] for g in golden)} park+restore in between, each turn equal to one stream."),
        (f"Resident memory {before['rss'] / mib:.0f} MiB after the warm-up, {end['rss'] / mib:.0f} MiB once idle "
         f"at the end (allowed {s['rss_slack_frac']:.0%} + {s['rss_slack_mib']:g} MiB more; sampled each second "
         f"after the warm-up: {min(samples):.0f} to {max(samples):.0f} MiB). File descriptors {before['fds']} after the warm-up, "
         f"{end['fds']} once idle. Endpoint labels: {len(end.get('labels') or [])} "
         f"({', '.join(end.get('labels') or [])})."),
    ]
    if rows:
        lines.append(f"Rows once idle: {rows['free']} of {rows['size']} free, {rows['session_rows']} held by "
                     f"{rows['sessions']} live sessions.")
    if "exit" in about:
        lines.append(f"On SIGTERM at the end the server exited with status {about['exit']}; its log has "
                     f"{about.get('log_errors', 0)} error lines.")
    answers = {op: ", ".join(f"{k}: {v}" for k, v in report["answers"].get(op, {}).items()) for op in report["mix"]}
    lines += ["", *harness.table(["operation", "runs", "answers by status"],
                                 [[op, n, answers[op] or "(raw connection)"] for op, n in report["mix"].items()])]
    failed = [c for c in CRITERIA if report["failures"][c]]
    for c in failed:
        lines += ["", f"Failures, {c} (first {len(report['failures'][c])} of {report['failure_counts'][c]}):", ""]
        lines += [f"- {m}" for m in report["failures"][c]]
    lines += ["", measured_line(about["date"], about["machine"], about["versions"])]
    return "\n".join(lines) + "\n"


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
             "machine": machine(), "versions": versions()}
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


def measure(args, command):
    if args.max_sessions < 2 * (args.workers + args.golden):
        raise InputError("--max-sessions must be at least 2 x (--workers + --golden): the golden sessions must never "
                         "be the least recently used one evicted")
    with tempfile.TemporaryDirectory(prefix="txl-serve-chaos-") as tmp:
        report, about = serve_and_run(args, Path(tmp))
    logger.info(summary(report))
    text = harness.results_markdown("HTTP serving under chaos: faults from the clients, what holds after",
                                    markdown(report, about), command)
    return text, {"report": report, "about": about, "command": command}, 0 if passed(report) else 1


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
    p.add_argument("--in-process", action="store_true", help="serve the app in this process (rows counted exactly)")
    return harness.main("serve_chaos", p, measure, argv)


if __name__ == "__main__":
    sys.exit(main())
