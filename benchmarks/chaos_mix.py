"""What the chaos's clients do to `txl-deploy serve` (serve_chaos.py runs them, then checks the server): each
operation (`MIX`, picked by weight) a seeded mix of requests and faults, every answer recorded against what the
API documents for it. The operations are listed in docs/benchmarks.md ("Serving")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger(__name__)

DOCUMENTED_503 = ("loading", "draining")  # error codes of the 503s the API documents (not an engine that died)
JUNK = "zzjunk"  # in every unknown path the chaos sends, so a label made from one is found
CRITERIA = {  # what must hold after the chaos, as the results file says it
    "server_errors": "no 5xx but a documented 503 (loading, draining)",
    "hangs": "every request answered within the timeout, streams included",
    "answers": "every answer one the API documents for what was sent",
    "rows": "idle: every row free or one live session's; all usable at once",
    "fds": "file descriptors back to their count after the warm-up",
    "rss": "resident memory flat after the warm-up",
    "golden": "golden sessions equal one in-process stream",
    "labels": "endpoint labels bounded by the routes",
}
KEPT_PER_CRITERION = 25  # failure messages kept per criterion (all are counted)

OK, BUSY = 200, 429
ANSWERED = {OK, BUSY}
SESSION_GONE = {404}

# operation: weight in the mix
MIX = {
    "complete": 6, "stream": 6, "conversation": 3, "disconnect_stream": 3, "disconnect_prompt": 2,
    "disconnect_upload": 2, "slow_reader": 1, "idle_socket": 1, "slowloris": 1, "session_pair": 2,
    "restore_delete": 4, "churn": 3, "corrupt_restore": 2, "junk_path": 3, "oversize": 1, "wrong_key": 2,
    "reads": 2,
}


@dataclass
class Target:
    """The server under test: where it listens, its process, the limits it was started with."""
    url: str
    pid: int
    max_batch: int
    max_sessions: int
    max_body_bytes: int = 1 << 20
    max_tokens: int = 4096
    max_prompt_tokens: int = 8192
    api_key: str | None = None


@dataclass
class ChaosSettings:
    duration_s: float = 30.0  # the chaos after the warm-up
    warmup_s: float = 6.0
    workers: int = 6  # operations at once
    max_ops: int = 100_000  # and at most this many operations (warm-up included)
    seed: int = 0
    timeout_s: float = 60.0  # any one operation, every request of it included
    golden: int = 2  # golden conversations
    golden_turns: int = 6
    race_pairs: int = 6  # restore+DELETE pairs per restore_delete operation
    hold_s: float = 2.0  # how long slow readers, idle sockets and slowloris hold their connection
    settle_s: float = 30.0  # how long the idle server may take to give rows and descriptors back
    fd_slack: int = 0
    rss_slack_frac: float = 0.05
    rss_slack_mib: float = 32.0
    logprob_atol: float = 1e-5


class Hang(Exception):
    """An operation got no answer in time."""


def strict_json(text):
    """JSON as an OpenAI client parses it: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


class ChaosClient:
    """The clients' side: the requests, the operations, and every answer recorded (`counts`) with what failed
    (`failures`, one list per criterion)."""

    def __init__(self, target: Target, settings: ChaosSettings):
        self.t, self.s = target, settings
        u = urlsplit(target.url)
        self.host, self.port = u.hostname, u.port
        self.auth = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
        self.counts: dict[str, Counter] = {}
        self.failures = {c: [] for c in CRITERIA}
        self.failure_counts = Counter()
        self.ids = itertools.count()
        self.blob = b""  # a parked state of this model, for restores
        self.texts: list[str] = []  # text the model wrote, for text prompts the vocabulary surely reads
        self.client: httpx.AsyncClient | None = None  # the pooled client of the phase running now
        self.n_token = self.session_bytes = 0  # from /v1/models
        self.started = time.monotonic()

    # -- recording -----------------------------------------------------------------------------------------------
    def fail(self, criterion: str, message: str):
        self.failure_counts[criterion] += 1
        if len(self.failures[criterion]) < KEPT_PER_CRITERION:
            self.failures[criterion].append(f"[{time.monotonic() - self.started:.1f} s] {message}")
        logger.debug("%s: %s", criterion, message)

    def answer(self, op: str, what: str, status: int, body: bytes, expected) -> dict | None:
        """Record one answer; returns its JSON body when it is JSON."""
        self.counts.setdefault(op, Counter())[str(status)] += 1
        parsed = None
        if body[:1] in (b"{", b"["):
            try:
                parsed = strict_json(body)
            except ValueError as e:
                self.fail("answers", f"{op}: {what} -> {status} with a body that is not JSON ({e})")
        error = (parsed or {}).get("error") if isinstance(parsed, dict) else None
        message = f"{error.get('code')}: {error.get('message', '')[:200]}" if isinstance(error, dict) else ""
        if status >= 500 and not (status == 503 and isinstance(error, dict) and error.get("code") in DOCUMENTED_503):
            self.fail("server_errors", f"{op}: {what} -> {status} {message}")
        elif expected is not None and status not in expected:
            self.fail("answers", f"{op}: {what} -> {status} (expected {sorted(expected)}) {message}")
        return parsed

    async def request(self, op, method, path, expected, *, json_body=None, content=None, headers=None,
                      lenient=False, client=None):
        """One request: (status, parsed JSON or None, body), or None when no answer came (a transport error, a
        failure unless `lenient`: a server may close on a body it refuses)."""
        client = client or self.client
        what = f"{method} {path}"
        try:
            r = await client.request(method, path, json=json_body, content=content, headers={**self.auth, **(headers or {})})
        except httpx.TimeoutException:
            raise Hang(f"{op}: {what}: no answer within {self.s.timeout_s:g} s") from None
        except httpx.TransportError as e:
            self.counts.setdefault(op, Counter())["no answer"] += 1
            if not lenient:
                self.fail("answers", f"{op}: {what}: no answer ({type(e).__name__}: {e})")
            return None
        return r.status_code, self.answer(op, what, r.status_code, r.content, expected), r.content

    async def stream(self, op, body, *, events=None, tick=0.0, hold=None, expect_done=True, expected=ANSWERED):
        """A streamed completion: read `events` events (then disconnect), or every one (with `tick` seconds
        between reads, for at most `hold` seconds, then disconnect). Returns status, tokens, log-probs, done."""
        out, started = {"status": None, "tokens": [], "logprobs": [], "done": False, "error": None}, time.monotonic()
        try:
            async with self.client.stream("POST", "/v1/completions", json=body, headers=self.auth) as r:
                out["status"] = r.status_code
                self.answer(op, "POST /v1/completions (stream)", r.status_code,
                            b"" if r.status_code == OK else await r.aread(), expected)
                if r.status_code != OK:
                    return out
                n = 0
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        out["done"] = True
                        break
                    try:
                        event = strict_json(data)
                    except ValueError as e:
                        self.fail("answers", f"{op}: a stream event that is not JSON ({e}): {data[:120]}")
                        return out
                    if "error" in event:
                        err = out["error"] = event["error"]
                        if err.get("type") == "server_error":
                            self.fail("server_errors", f"{op}: the stream failed: {err.get('message', '')[:200]}")
                        continue
                    choice = event["choices"][0] if event.get("choices") else {}
                    out["tokens"] += choice.get("token_ids") or []
                    out["logprobs"] += (choice.get("logprobs") or {}).get("token_logprobs") or []
                    n += 1
                    if (events is not None and n >= events) or (hold is not None and time.monotonic() - started > hold):
                        return out  # leaving the block closes the connection: a disconnect mid-stream
                    if tick:
                        await asyncio.sleep(tick)
        except httpx.TimeoutException:
            raise Hang(f"{op}: a stream got nothing for {self.s.timeout_s:g} s") from None
        except httpx.TransportError as e:
            self.fail("answers", f"{op}: the stream broke off ({type(e).__name__}: {e})")
            return out
        if expect_done and not out["done"] and out["error"] is None:
            self.fail("answers", f"{op}: the stream ended without [DONE]")
        return out

    async def raw(self, payload: bytes, hold: float, trickle: bytes = b"", tick: float = 0.25):
        """A raw connection: send `payload`, then `trickle` a byte per tick, for `hold` seconds; then close."""
        _, writer = await asyncio.open_connection(self.host, self.port)
        with contextlib.suppress(ConnectionError, OSError):  # the server may close first: that is allowed
            try:
                writer.write(payload)
                await writer.drain()
                end = time.monotonic() + hold
                for b in itertools.cycle(trickle or b"\0"):
                    if time.monotonic() >= end:
                        break
                    if trickle:
                        writer.write(bytes([b]))
                        await writer.drain()
                    await asyncio.sleep(min(tick, max(0.0, end - time.monotonic())))
            finally:
                writer.close()
                await writer.wait_closed()

    def sid(self, kind: str) -> str:
        return f"{kind}-{next(self.ids)}"

    def prompt(self, rng: random.Random, longest: int = 48):
        if self.texts and rng.random() < 0.3:
            return rng.choice(self.texts)
        return [rng.randrange(self.n_token) for _ in range(rng.randint(1, min(longest, self.t.max_prompt_tokens)))]

    async def new_session(self, op: str, kind: str) -> str | None:
        """A session of a fresh id made for `op`: its id, or None where the server refused (full: 503)."""
        sid = self.sid(kind)
        got = await self.request(op, "POST", "/v1/sessions", {201, BUSY}, json_body={"id": sid})
        return sid if got and got[0] == 201 else None

    async def gone(self, op, sid):
        """DELETE a session until it is gone (200 or 404); a session may be busy for a moment (409)."""
        for _ in range(100):
            got = await self.request(op, "DELETE", f"/v1/sessions/{sid}", {200, 404, 409})
            if got is None or got[0] != 409:
                return
            await asyncio.sleep(0.05)
        self.fail("answers", f"{op}: session {sid} stayed busy for 5 s with nothing running on it")

    # -- the operations ---------------------------------------------------------------------------------------------
    async def op_complete(self, rng):
        body = {"prompt": self.prompt(rng), "max_tokens": rng.randint(1, 12), "temperature": rng.choice([0, 0.8])}
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            body["stop"] = [" "]
        got = await self.request("complete", "POST", "/v1/completions", ANSWERED, json_body=body)
        if got and got[0] == OK and len(self.texts) < 64 and got[1]["choices"][0]["text"].strip():
            self.texts.append(got[1]["choices"][0]["text"].strip())

    async def op_stream(self, rng):
        body = {"prompt": self.prompt(rng), "max_tokens": rng.randint(1, 24), "temperature": 0, "stream": True,
                "return_token_ids": rng.random() < 0.5}
        if rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            body["logprobs"] = 2
        await self.stream("stream", body)

    async def op_conversation(self, rng):
        sid = await self.new_session("conversation", "conv")
        if sid is None:
            return
        answered = False  # a turn without a prompt continues what the last answered turn left
        for _ in range(rng.randint(2, 4)):
            prompt = [] if answered and rng.random() < 0.3 else self.prompt(rng)
            body = {"prompt": prompt, "max_tokens": rng.randint(1, 8), "temperature": 0, "session_id": sid}
            if rng.random() < 0.5:
                answered = (await self.stream("conversation", {**body, "stream": True}))["done"]
            else:
                got = await self.request("conversation", "POST", "/v1/completions", ANSWERED, json_body=body)
                answered = bool(got) and got[0] == OK
        await self.gone("conversation", sid)

    async def op_disconnect_stream(self, rng):
        body = {"prompt": self.prompt(rng), "max_tokens": 200, "temperature": 0.8, "stream": True}
        # half of them a session's request: cut off, the session keeps what was fed
        sid = await self.new_session("disconnect_stream", "cut") if rng.random() < 0.5 else None
        await self.stream("disconnect_stream", {**body, "session_id": sid} if sid else body, events=rng.randint(1, 5))
        if sid:
            await self.gone("disconnect_stream", sid)

    async def op_disconnect_prompt(self, rng):
        """A long prompt, abandoned while it is probably still being fed (or just after)."""
        n = min(self.t.max_prompt_tokens, 256)
        body = {"prompt": [rng.randrange(self.n_token) for _ in range(n)], "max_tokens": 4,
                "stream": rng.random() < 0.5}
        with contextlib.suppress(asyncio.TimeoutError):  # the client goes away: the connection closes under it
            await asyncio.wait_for(self.request("disconnect_prompt", "POST", "/v1/completions", ANSWERED,
                                                json_body=body), rng.uniform(0.0, 0.05))

    async def op_disconnect_upload(self, rng):
        """Headers and half the body, then the connection closes."""
        path = "/v1/completions"
        body = json.dumps({"prompt": self.prompt(rng), "max_tokens": 4}).encode()
        if rng.random() < 0.5 and self.blob:
            path, body = f"/v1/sessions/{self.sid('upload')}/restore", self.blob
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.auth.items()) + "\r\n")
        await self.raw(head.encode() + body[:rng.randint(0, len(body) - 1)], hold=rng.uniform(0, 0.2))

    async def op_slow_reader(self, rng):
        body = {"prompt": self.prompt(rng), "max_tokens": 100, "temperature": 0.8, "stream": True}
        await self.stream("slow_reader", body, tick=rng.uniform(0.05, 0.2), hold=self.s.hold_s, expect_done=False)

    async def op_idle_socket(self, rng):
        # connects and says nothing, or sends one request and then nothing more
        req = b"" if rng.random() < 0.5 else f"GET /health HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode()
        await self.raw(req, hold=self.s.hold_s)

    async def op_slowloris(self, rng):
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\n".encode()
        await self.raw(head, hold=self.s.hold_s, trickle=b"X-Slow: " + b"a" * 64, tick=rng.uniform(0.1, 0.4))

    async def op_session_pair(self, rng):
        """Two requests on one session at once (one may be refused with 409), and a DELETE while one runs."""
        sid = await self.new_session("session_pair", "pair")
        if sid is None:
            return
        await self.request("session_pair", "POST", "/v1/completions", ANSWERED,
                           json_body={"prompt": self.prompt(rng), "max_tokens": 2, "session_id": sid})
        body = {"prompt": self.prompt(rng, 8), "max_tokens": rng.randint(1, 16), "temperature": 0, "session_id": sid}
        deleting = rng.random() < 0.5
        expected = ANSWERED | {409} | (SESSION_GONE if deleting else set())  # a DELETE first: the session is gone
        calls = [self.request("session_pair", "POST", "/v1/completions", expected, json_body=body),
                 self.stream("session_pair", {**body, "stream": True}, expected=expected) if rng.random() < 0.5 else
                 self.request("session_pair", "POST", "/v1/completions", expected, json_body=body)]
        if deleting:
            calls.append(self.request("session_pair", "DELETE", f"/v1/sessions/{sid}", {200, 409}))
        await asyncio.gather(*calls)
        await self.gone("session_pair", sid)

    async def op_restore_delete(self, rng):
        """Restore and DELETE of one session at the same moment, over and over: DELETEs sent one after another
        until the restore has its answer (so one lands while the restore is loading the row), or one DELETE after
        a random moment; sometimes a completion on the session joins."""
        for _ in range(self.s.race_pairs):
            sid, restored = self.sid("race"), asyncio.Event()
            hammer = rng.random() < 0.7
            calls = [self.race_restore(sid, restored),
                     self.race_delete(sid, restored, 200 if hammer else 1, 0 if hammer else rng.uniform(0, 0.01))]
            if rng.random() < 0.3:
                calls.append(self.request("restore_delete", "POST", "/v1/completions", ANSWERED | {404, 409},
                                          json_body={"prompt": [1], "max_tokens": 2, "session_id": sid}))
            await asyncio.gather(*calls)
            await self.gone("restore_delete", sid)

    async def race_restore(self, sid: str, restored: asyncio.Event):
        try:
            await self.request("restore_delete", "POST", f"/v1/sessions/{sid}/restore", {201, 404, 409, 410, BUSY},
                               content=self.blob)
        finally:
            restored.set()

    async def race_delete(self, sid: str, restored: asyncio.Event, tries: int, delay: float):
        await asyncio.sleep(delay)
        for _ in range(tries):
            got = await self.request("restore_delete", "DELETE", f"/v1/sessions/{sid}", {200, 404, 409})
            if restored.is_set() or (got and got[0] == 200):
                return

    async def op_churn(self, rng):
        """Create, feed, park, restore under a new id, continue, delete; and the refusals on the way."""
        sid, again = await self.new_session("churn", "churn"), self.sid("churn")
        if sid is None:
            return
        if rng.random() < 0.3:  # parking a session that holds nothing is refused, and leaves it as it was
            await self.request("churn", "POST", f"/v1/sessions/{sid}/park", {400})
            await self.request("churn", "GET", f"/v1/sessions/{sid}", {200})
        got = await self.request("churn", "POST", "/v1/completions", ANSWERED,
                                 json_body={"prompt": self.prompt(rng), "max_tokens": 3, "session_id": sid})
        if not got or got[0] != OK:
            return await self.gone("churn", sid)
        got = await self.request("churn", "POST", f"/v1/sessions/{sid}/park", {200})
        if not got or got[0] != OK:
            return await self.gone("churn", sid)
        blob = got[2]
        await self.request("churn", "GET", f"/v1/sessions/{sid}", SESSION_GONE)  # parked: gone, says so
        await self.request("churn", "POST", f"/v1/sessions/{again}/restore", {201, BUSY}, content=blob)
        await self.request("churn", "POST", f"/v1/sessions/{again}/restore", {409, BUSY}, content=blob)
        await self.request("churn", "POST", "/v1/completions", ANSWERED,
                           json_body={"prompt": "", "max_tokens": 2, "session_id": again})
        await self.request("churn", "DELETE", f"/v1/sessions/{again}", {200})
        await self.request("churn", "DELETE", f"/v1/sessions/{again}", SESSION_GONE)

    async def op_corrupt_restore(self, rng):
        sid, blob, kind = self.sid("bad"), bytearray(self.blob), rng.choice(["random", "truncated", "flipped", "zip",
                                                                              "empty"])
        if kind == "flipped":  # may land in the arrays' values (a valid state of other numbers) or in the format
            for _ in range(rng.randint(1, 8)):
                blob[rng.randrange(len(blob))] ^= 1 << rng.randrange(8)
        body = {"random": lambda: rng.randbytes(rng.randint(1, 5000)), "truncated": lambda: blob[:rng.randint(
                    1, len(blob) - 1)], "flipped": lambda: blob, "empty": lambda: b"",
                "zip": lambda: b"PK\x03\x04" + rng.randbytes(rng.randint(0, 2000))}[kind]()
        got = await self.request("corrupt_restore", "POST", f"/v1/sessions/{sid}/restore",
                                 {201, 400} if kind == "flipped" else {400}, content=bytes(body))
        if got and got[0] == 201:
            await self.gone("corrupt_restore", sid)
        elif got:  # a refused restore makes no session
            await self.request("corrupt_restore", "GET", f"/v1/sessions/{sid}", SESSION_GONE)

    async def op_junk_path(self, rng):
        tag = f"{JUNK}{rng.randrange(1 << 30):x}"
        session = f"/v1/sessions/{self.sid('j')}"  # half of them under a session, as scanners walk an API's tree
        path = rng.choice([f"{session}/{tag}", f"{session}/{tag}/park", f"{session}/park/{tag}", f"{session}/{tag}/x",
                           f"/{tag}", f"/v1/{tag}", f"/v1/completions/{tag}", f"/v1/sessions/{tag}/restore/x",
                           f"/metrics/{tag}", f"/{tag}/%2e%2e/v1/models"])
        method = rng.choice(["GET", "POST", "DELETE", "PUT", "PATCH"])
        await self.request("junk_path", method, path, {400, 401, 404, 405}, content=b"{}")

    async def op_oversize(self, rng):
        limit = self.t.max_body_bytes
        size = limit + rng.randint(1, limit)
        path, expected = "/v1/completions", {413}
        if rng.random() < 0.3:
            path = f"/v1/sessions/{self.sid('big')}/restore"
            size = self.session_bytes + (1 << 20) + rng.randint(1, limit)
        headers = None
        if rng.random() < 0.3 and self.auth:  # also without the key: refused either way, never buffered whole
            headers, expected = {"Authorization": "Bearer not-the-key"}, {401, 413}
        if rng.random() < 0.5:
            content = b" " * size  # declared in Content-Length
        else:
            async def chunks(size=size):  # chunked: no length said in advance
                for _ in range(0, size, 1 << 16):
                    yield b" " * (1 << 16)
            content = chunks()
        await self.request("oversize", "POST", path, expected, content=content, headers=headers, lenient=True)

    async def op_wrong_key(self, rng):
        if not self.auth:
            return await self.op_reads(rng)
        key = self.t.api_key
        header = rng.choice([None, "Bearer wrong", f"Bearer {key}x", f"Bearer {key[:-1]}", f"Basic {key}",
                             f"Bearer {key.upper()}" if key.upper() != key else "Bearer ?", "Bearer"])
        headers = {"Authorization": header} if header else {"Authorization": ""}
        method, path, kw = rng.choice([
            ("POST", "/v1/completions", {"json_body": {"prompt": [1, 2], "max_tokens": 2}}),
            ("GET", "/v1/models", {}), ("GET", "/v1/sessions", {}), ("POST", "/v1/sessions", {"json_body": {}}),
            ("DELETE", f"/v1/sessions/{self.sid('k')}", {}),
            ("POST", f"/v1/sessions/{self.sid('k')}/restore", {"content": self.blob}),
        ])
        async with self.client_for_one() as client:  # the wrong header, not the pool's right one
            await self.request("wrong_key", method, path, {401}, headers=headers, client=client, **kw)

    async def op_reads(self, rng):
        for path, expected in (("/health", {200}), ("/v1/models", {200}), ("/metrics", {200}),
                               ("/v1/sessions", {200}), (f"/v1/sessions/{self.sid('none')}", SESSION_GONE)):
            if rng.random() < 0.5:
                await self.request("reads", "GET", path, expected)

    def client_for_one(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.t.url, timeout=self.s.timeout_s)
