"""A session's life as one state machine, and an engine that never dies silently.

Sessions: the windows a race could use (a restore or a park in progress) are held open on purpose and refuse what
they must; create, restore, completion, cancel, park, delete, fork, eviction and the idle TTL driven concurrently,
many times, against a real server leave every row of the batched memory accounted for (free, or held once by a live
session), and golden sessions continued through it all equal one long TxlRuntime stream (a golden fork and its
source, continued at once, each their own).

Failures: a step that raises fails the requests it concerned with a 500 in OpenAI's shape and the engine goes on;
one that leaves the engine's state broken stops it: every request it held is answered, /health and new requests get
503, and `txl-deploy serve` exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from helpers import conversations
from helpers.engine_gate import EventRecorder

from txl_deploy.errors import TxlError
from txl_deploy.runtimes import SamplingParams, TxlRuntime
from txl_deploy.serving.http import batch_steps as batch_steps_module
from txl_deploy.serving.http import scheduler as scheduler_module
from txl_deploy.serving.http.protocol import ApiError
from txl_deploy.serving.http.scheduler import EngineBroken, Job, Scheduler
from txl_deploy.serving.http.server import EngineFailed, exit_error
from txl_deploy.serving.ports import free_port

A = [int(t) for t in np.random.default_rng(11).integers(0, 58, size=20)]  # longer than max_segment (16)
B = [5, 9, 13, 2]
C = [40, 41, 7]
BOUND_S = 60  # no single wait in these tests takes longer on any machine that runs the suite


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n)


def _turn(engine, session, prompt, n) -> list[int]:
    """One request on the session, run to its end: the tokens."""
    rec = EventRecorder()
    engine.submit(Job(prompt, _greedy(n), rec.emit, session_id=session))
    assert rec.done.wait(BOUND_S)
    assert rec.events[-1][0] == "done", rec.events[-1]
    return rec.tokens


def _stream_tokens(tiny_onnx, segments) -> list[list[int]]:
    """Per request, the greedy tokens of one TxlRuntime stream fed these (prompt, n) requests."""
    out, _ = conversations.greedy_segments(TxlRuntime.load(tiny_onnx), segments)
    return [toks for toks, _ in out]


def _between_steps(engine, fn):
    return engine.call(fn).result(BOUND_S)


@contextlib.contextmanager
def _engine_held(engine):
    """The engine thread waits between two steps until the block ends: whatever is sent meanwhile queues."""
    entered, leave = threading.Event(), threading.Event()
    engine.call(lambda: (entered.set(), leave.wait(BOUND_S)))
    assert entered.wait(BOUND_S)
    try:
        yield
    finally:
        leave.set()


def _noting(store, name):
    """Wrap the store's method `name`: the returned event is set once a call of it has returned."""
    called = threading.Event()
    method = getattr(store, name)

    def noted(*args, **kwargs):
        out = method(*args, **kwargs)
        called.set()
        return out

    setattr(store, name, noted)
    return called


def _refused(call, status, words):
    with pytest.raises(ApiError) as e:
        call()
    assert e.value.status == status and words in e.value.message, e.value.message
    return e.value


def _rows_accounted(engine):
    """In the engine thread: every row free or used once, the used ones exactly the live sessions' rows."""
    def look():
        held = [s.handle for s in engine.sessions.live() if s.handle is not None]
        return engine.rows.accounted(), sorted(engine.rows.used), sorted(held), len(engine.rows.free)
    accounted, used, held, free = _between_steps(engine, look)
    assert accounted
    assert used == held, "a row is used by no live session (leaked), or a session holds a free row"
    assert free + len(used) == engine.rows.size


@pytest.fixture
def engine(tiny_onnx):
    eng = Scheduler(TxlRuntime.load(tiny_onnx), max_batch=2, max_sessions=3, max_queue=8)
    eng.start()
    yield eng
    eng.stop(10)


def _parked(engine, tiny_onnx) -> bytes:
    engine.create_session("source")
    _turn(engine, "source", A, 3)
    return engine.park("source")


# -- the state machine, one window at a time ------------------------------------------------------------------------
def test_a_restoring_session_is_refused_to_everyone_until_its_memory_is_in(engine, tiny_onnx):
    blob = _parked(engine, tiny_onnx)
    made = _noting(engine.sessions, "create")
    with ThreadPoolExecutor(1) as pool:
        with _engine_held(engine):
            restoring = pool.submit(engine.restore, "r", blob)
            assert made.wait(BOUND_S)
            assert engine.sessions.get("r").state == "loading"
            _refused(lambda: engine.delete_session("r"), 409, "is being restored")
            _refused(lambda: engine.park("r"), 409, "is being restored")
            _refused(lambda: engine.submit(Job(B, _greedy(2), EventRecorder().emit, session_id="r")), 409,
                     "is being restored")
            # neither eviction nor the TTL takes it: 3 sessions at most, the idle ones go first
            for sid in ("e1", "e2", "e3"):
                engine.create_session(sid)
            assert sorted(engine.sessions.all_ids()) == ["e2", "e3", "r"]
            engine.sessions.get("r").used -= 10 * engine.sessions.ttl
            engine.sessions.expire()
            assert engine.sessions.get("r").state == "loading"
        session = restoring.result(BOUND_S)
    assert session.state == "idle" and session.tokens == len(A) + 3
    assert _turn(engine, "r", B, 4) == _stream_tokens(tiny_onnx, [(A, 3), (B, 4)])[1]
    engine.delete_session("r")
    _rows_accounted(engine)


def test_a_restore_that_fails_leaves_nothing_behind(engine, tiny_onnx, monkeypatch):
    blob = _parked(engine, tiny_onnx)

    def no_row():
        raise MemoryError("no room for the row")

    monkeypatch.setattr(engine.rows, "start", no_row)
    with pytest.raises(MemoryError):
        engine.restore("r", blob)
    monkeypatch.undo()
    _refused(lambda: engine.sessions.get("r"), 404, "could not be restored")
    _rows_accounted(engine)


def test_parking_ends_a_session_only_once_its_bytes_exist(engine, tiny_onnx, monkeypatch):
    engine.create_session("p")
    _turn(engine, "p", A, 3)
    began = _noting(engine.sessions, "begin_park")
    with ThreadPoolExecutor(1) as pool:
        with _engine_held(engine):
            parking = pool.submit(engine.park, "p")
            assert began.wait(BOUND_S)
            assert engine.sessions.get("p").state == "parking"
            _refused(lambda: engine.delete_session("p"), 409, "is being parked")
            _refused(lambda: engine.submit(Job(B, _greedy(2), EventRecorder().emit, session_id="p")), 409,
                     "is being parked")
            _refused(lambda: engine.park("p"), 409, "is being parked")
        assert parking.result(BOUND_S)[:2] == b"PK"  # an .npz
    _refused(lambda: engine.sessions.get("p"), 404, "was parked")
    _rows_accounted(engine)  # its row went back

    # the bytes cannot be made: the session stays, memory and all
    engine.create_session("q")
    _turn(engine, "q", A, 3)

    def disk_full(backend, arrays, last_log_probs=None):
        raise OSError("no space left on device")

    monkeypatch.setattr(scheduler_module, "state_bytes", disk_full)
    with pytest.raises(OSError):
        engine.park("q")
    monkeypatch.undo()
    assert engine.sessions.get("q").state == "idle"
    assert _turn(engine, "q", B, 4) == _stream_tokens(tiny_onnx, [(A, 3), (B, 4)])[1]

    # a session never fed has nothing to park: a 400, and it is still there to be used
    engine.create_session("fresh")
    _refused(lambda: engine.park("fresh"), 400, "has no memory yet")
    assert engine.sessions.get("fresh").state == "idle"
    assert _turn(engine, "fresh", B, 3) == _stream_tokens(tiny_onnx, [(B, 3)])[0]
    _rows_accounted(engine)


@pytest.mark.parametrize("prompt", [[], C], ids=["continue", "prompt"])
def test_a_cancelled_queued_request_leaves_its_session_as_it_was(engine, tiny_onnx, prompt):
    engine.create_session("s")
    _turn(engine, "s", A, 3)
    before = engine.sessions.get("s").last_log_probs.copy()
    with _engine_held(engine):
        job = Job(prompt, _greedy(4), EventRecorder().emit, session_id="s")
        engine.submit(job)
        engine.cancel(job)  # taken in the same turn as the job: it never reaches a row
    _between_steps(engine, lambda: None)
    session = engine.sessions.get("s")
    assert session.state == "idle" and session.tokens == len(A) + 3
    np.testing.assert_array_equal(session.last_log_probs, before)
    assert _turn(engine, "s", [], 5) == _stream_tokens(tiny_onnx, [(A, 3), ([], 5)])[1]


def test_a_call_failing_part_way_counts_what_each_session_took(tiny_onnx, monkeypatch):
    """Two sessions whose rows (0 and 4) are two backend calls of one step: the second call fails. Both requests
    get 500; the first session's memory took the prompt (counted, nothing to continue from), the second's took
    nothing and goes on as if never asked."""
    eng = Scheduler(TxlRuntime.load(tiny_onnx), max_batch=2, max_sessions=5, max_queue=8)
    eng.start()
    try:
        for sid in "abcde":
            eng.create_session(sid)
            _turn(eng, sid, A, 1)
        for sid in "bcd":
            eng.delete_session(sid)
        assert (eng.sessions.get("a").handle, eng.sessions.get("e").handle) == (0, 4)
        before = eng.sessions.get("e").last_log_probs.copy()
        run, calls = eng.backend.run, []

        def second_fails(*args):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected fault in the second span")
            return run(*args)

        recs = {sid: EventRecorder() for sid in "ae"}
        with _engine_held(eng):  # both in the same step
            monkeypatch.setattr(eng.backend, "run", second_fails)
            for sid, rec in recs.items():
                eng.submit(Job(B, _greedy(3), rec.emit, session_id=sid))
        for rec in recs.values():
            assert rec.done.wait(BOUND_S)
            kind, error = rec.events[-1]
            assert kind == "error" and error.status == 500 and error.code == "model_error"
        monkeypatch.undo()
        a, e = eng.sessions.get("a"), eng.sessions.get("e")
        assert a.tokens == len(A) + 1 + len(B) and a.last_log_probs is None
        assert e.tokens == len(A) + 1
        np.testing.assert_array_equal(e.last_log_probs, before)
        assert _turn(eng, "e", [], 3) == _stream_tokens(tiny_onnx, [(A, 1), ([], 3)])[1]
        assert eng.alive
        _rows_accounted(eng)
    finally:
        eng.stop(10)


def test_rows_are_handed_out_within_their_count_and_back_once(engine):
    rows = engine.rows
    taken = [rows.start() for _ in range(len(rows.free))]
    assert rows.accounted() and len(rows.used) == rows.size
    with pytest.raises(RuntimeError, match="in use"):
        rows.start()
    rows.release(taken[0])
    with pytest.raises(ValueError, match="not in use"):
        rows.release(taken[0])
    for row in taken[1:]:
        rows.release(row)
    assert rows.accounted() and len(rows.free) == rows.size
    rows.free.append(rows.free[0])  # a row both free twice over: the pool sees it
    assert not rows.accounted()
    rows.free.pop()


# -- every interleaving at once, over HTTP --------------------------------------------------------------------------
GOLDEN_TURNS = [(A, 4), (B, 3), "park", ([], 3), (C, 4)]
ALLOWED = {  # what each call may answer while others race it; never a 5xx
    "restore": {201, 409, 429}, "delete": {200, 404, 409}, "park": {200, 400, 404, 409},
    "complete": {200, 400, 404, 409}, "create": {201, 409, 429}, "fork": {201, 404, 409, 429}}


class _Chaos:
    """Clients racing each other on a server: every answer is checked against what that call may answer."""

    def __init__(self, client: httpx.AsyncClient, engine, blob: bytes, seed: int):
        self.c, self.engine, self.blob = client, engine, blob
        self.rng = np.random.default_rng(seed)
        self.seen: dict[str, list[int]] = {k: [] for k in ALLOWED}
        self.made = 0

    def _id(self, what):
        self.made += 1
        return f"chaos-{what}-{id(self)}-{self.made}"

    def _check(self, what, r: httpx.Response):
        self.seen[what].append(r.status_code)
        assert r.status_code in ALLOWED[what], f"{what}: {r.status_code} {r.text}"
        if r.status_code >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], r.text
        return r.status_code

    async def _jitter(self):
        # a random point in time for the other side of a race to land on (chaos, not synchronisation)
        await asyncio.sleep(float(self.rng.uniform(0, 0.01)))

    def restore(self, sid):
        return self.c.post(f"/v1/sessions/{sid}/restore", content=self.blob)

    def complete(self, sid, prompt, n, **extra):
        return self.c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                     "session_id": sid, **extra})

    async def restore_and_delete(self):
        sid = self._id("rd")
        restored, deleted = await asyncio.gather(self.restore(sid), self._later(self.c.delete(f"/v1/sessions/{sid}")))
        r, d = self._check("restore", restored), self._check("delete", deleted)
        assert not (d == 200 and r != 201)
        if r == 201 and d != 200:
            self._check("delete", await self.c.delete(f"/v1/sessions/{sid}"))

    async def restore_and_complete(self):
        sid = self._id("rc")
        restored, done = await asyncio.gather(self.restore(sid), self._later(self.complete(sid, B, 3)))
        r, d = self._check("restore", restored), self._check("complete", done)
        assert not (d == 200 and r != 201)
        if self.rng.random() < 0.5:  # else left for eviction or the TTL
            self._check("delete", await self.c.delete(f"/v1/sessions/{sid}"))

    async def park_complete_delete(self):
        sid = self._id("pc")
        if self._check("restore", await self.restore(sid)) != 201:
            return
        calls = [self.c.post(f"/v1/sessions/{sid}/park"), self.complete(sid, C, 2),
                 self.c.delete(f"/v1/sessions/{sid}")]
        parked, done, deleted = await asyncio.gather(*(self._later(x) for x in calls))
        p, _, d = self._check("park", parked), self._check("complete", done), self._check("delete", deleted)
        assert not (p == 200 and d == 200)

    async def fork_race(self):
        # a fork racing a request on its source, a park and a delete: made whole, or refused
        sid, fid = self._id("fk"), self._id("fkd")
        if self._check("restore", await self.restore(sid)) != 201:
            return
        calls = [self.c.post(f"/v1/sessions/{sid}/fork", json={"id": fid}), self.complete(sid, C, 2),
                 self.c.post(f"/v1/sessions/{sid}/park"), self.c.delete(f"/v1/sessions/{sid}")]
        forked, done, parked, deleted = await asyncio.gather(*(self._later(x) for x in calls))
        self._check("complete", done), self._check("park", parked), self._check("delete", deleted)
        if self._check("fork", forked) == 201 and self.rng.random() < 0.5:
            self._check("complete", await self.complete(fid, B, 2))  # the fork goes on (or was evicted: 404)

    async def cancel_stream(self):
        sid = None
        if self.rng.random() < 0.5:
            sid = self._id("cs")
            if self._check("create", await self.c.post("/v1/sessions", json={"id": sid})) != 201:
                return
        body = {"prompt": A, "max_tokens": 200, "temperature": 0, "stream": True}
        if sid is not None:
            body["session_id"] = sid
        async with self.c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
            self._check("complete", r)
            async for line in r.aiter_lines():
                if line.startswith("data: ") and self.rng.random() < 0.3:
                    break  # the client goes away mid-stream

    async def cancel_waiting(self):
        sid = self._id("cw") if self.rng.random() < 0.5 else None
        if sid is not None:
            self._check("restore", await self.restore(sid))
        task = asyncio.ensure_future(self.complete(sid, B, 100))
        await self._jitter()
        task.cancel()  # in the queue, or running: either way its row and its session are freed
        with contextlib.suppress(asyncio.CancelledError):
            self._check("complete", await task)

    async def evict(self):
        for _ in range(2):  # sessions left alone: more than --max-sessions evicts the least recently used
            self._check("create", await self.c.post("/v1/sessions", json={"id": self._id("left")}))

    async def expire(self):
        # the idle TTL coming due at an arbitrary moment, for one session the clients race on (never a golden one)
        chaos = [s for s in self.engine.sessions.live() if s.id.startswith("chaos-")]
        if chaos:
            chaos[int(self.rng.integers(len(chaos)))].used -= 2 * self.engine.sessions.ttl

    async def _later(self, request):
        await self._jitter()
        return await request

    async def run(self, rounds):
        actions = [self.restore_and_delete, self.restore_and_delete, self.restore_and_complete,
                   self.park_complete_delete, self.cancel_stream, self.cancel_waiting, self.evict, self.expire,
                   self.fork_race]
        for _ in range(rounds):
            await actions[int(self.rng.integers(len(actions)))]()


async def _golden(c: httpx.AsyncClient, name: str) -> tuple[list, int]:
    """One conversation through GOLDEN_TURNS, parked and restored half way; started again (new id) if it is
    evicted meanwhile. Returns each turn's answer of the run that went through, and how many runs it took."""
    for attempt in range(1, 21):
        sid, got = f"{name}-{attempt}", []
        assert (await c.post("/v1/sessions", json={"id": sid})).status_code == 201
        for turn in GOLDEN_TURNS:
            if turn == "park":
                parked = await c.post(f"/v1/sessions/{sid}/park")
                if parked.status_code == 404:
                    break
                assert parked.status_code == 200, parked.text
                sid += "-restored"
                r = await c.post(f"/v1/sessions/{sid}/restore", content=parked.content)
                assert r.status_code == 201, r.text
                continue
            prompt, n = turn
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                       "logprobs": 1, "return_token_ids": True, "session_id": sid})
            if r.status_code == 404 and "evicted" in r.text:
                break
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0])
        else:
            return got, attempt
    raise AssertionError(f"{name} was evicted 20 times over")


FORKED_AT, SOURCE_TURNS, FORK_TURNS = (A, 4), [(B, 3), (C, 4)], [([], 3), (B, 2)]


async def _golden_fork(c: httpx.AsyncClient, name: str) -> tuple[list, list]:
    """A conversation forked after its first turn, then the source and the fork continued at the same time with
    other turns. Returns the source's answers and the fork's; started again (new ids) if a session is evicted."""

    async def turns(sid, segments):
        got = []
        for prompt, n in segments:
            r = await c.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                       "logprobs": 1, "return_token_ids": True, "session_id": sid})
            if r.status_code == 404 and "evicted" in r.text:
                return None
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0])
        return got

    for attempt in range(1, 21):
        sid = f"{name}-{attempt}"
        assert (await c.post("/v1/sessions", json={"id": sid})).status_code == 201
        first = await turns(sid, [FORKED_AT])
        forked = await c.post(f"/v1/sessions/{sid}/fork", json={"id": sid + "-fork"})
        if first is None or forked.status_code in (404, 429):
            continue
        assert forked.status_code == 201, forked.text
        source, fork = await asyncio.gather(turns(sid, SOURCE_TURNS), turns(sid + "-fork", FORK_TURNS))
        if source is not None and fork is not None:
            return first + source, first + fork
    raise AssertionError(f"{name} was evicted 20 times over")


def test_racing_clients_leave_every_row_accounted_for_and_golden_sessions_whole(make_server, tiny_onnx):
    srv = make_server(max_batch=4, max_sessions=8, max_queue=64)
    eng = srv.engine
    with httpx.Client(base_url=srv.url, timeout=BOUND_S) as c:
        assert c.post("/v1/sessions", json={"id": "seed"}).status_code == 201
        assert c.post("/v1/completions", json={"prompt": A, "max_tokens": 3, "session_id": "seed"}).status_code == 200
        blob = c.post("/v1/sessions/seed/park").content

    async def everyone():
        async with httpx.AsyncClient(base_url=srv.url, timeout=BOUND_S) as client:
            chaos = [_Chaos(client, eng, blob, seed) for seed in range(8)]
            goldens = [_golden(client, f"golden{i}") for i in range(2)]
            results = await asyncio.gather(*goldens, _golden_fork(client, "forkgold"), *(x.run(40) for x in chaos))
            return results[:2], results[2], chaos

    goldens, (source, fork), chaos = asyncio.run(asyncio.wait_for(everyone(), 4 * BOUND_S))
    want = conversations.greedy_segments(TxlRuntime.load(tiny_onnx), [t for t in GOLDEN_TURNS if t != "park"])[0]
    # the golden fork and its source, continued at once, each equal their own stream: neither wrote the other
    forks = [(source, [FORKED_AT, *SOURCE_TURNS]), (fork, [FORKED_AT, *FORK_TURNS])]
    for got, segments in [(got, None) for got, _ in goldens] + forks:
        stream = want if segments is None else conversations.greedy_segments(TxlRuntime.load(tiny_onnx), segments)[0]
        for choice, (toks, lps) in zip(got, stream, strict=True):
            assert choice["token_ids"] == toks
            want_lps = [lp[t] for lp, t in zip(lps, toks, strict=True)]
            np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want_lps, rtol=0, atol=1e-5)
    seen = {what: sum((x.seen[what] for x in chaos), []) for what in ALLOWED}
    # the races happened: sessions were restored and deleted, and calls were refused while another held the session
    assert seen["restore"].count(201) > 10 and seen["delete"].count(200) > 5, seen
    assert seen["delete"].count(409) + seen["complete"].count(409) > 0, seen
    assert seen["fork"].count(201) > 0 and seen["fork"].count(201) < len(seen["fork"]), seen  # forks made, and refused
    end = time.monotonic() + BOUND_S  # cancelled requests end at the engine's next turns
    while (eng.running or eng.queue_depth) and time.monotonic() < end:
        time.sleep(0.01)
    assert eng.running == 0 and eng.queue_depth == 0
    _rows_accounted(eng)
    for sid in eng.sessions.all_ids():
        with contextlib.suppress(ApiError):
            eng.delete_session(sid)
    _between_steps(eng, lambda: None)
    assert len(eng.rows.free) == eng.rows.size and not eng.rows.used
    assert httpx.get(srv.url + "/health").status_code == 200


# -- faults in the step -------------------------------------------------------------------------------------------
def _openai_error(body: dict, status_type: str, code: str) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == status_type and error["code"] == code, error
    return error


def _sse_events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


class _Faults:
    """A backend whose call number `at` (counted from 1) raises; the others are the backend's own."""

    def __init__(self, backend, at):
        self.run, self.at, self.calls = backend.run, set(at), 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls in self.at:
            raise RuntimeError("injected fault in the backend call")
        return self.run(*args)


def test_a_failing_step_fails_its_requests_with_500_and_the_engine_goes_on(make_server, tiny_onnx, monkeypatch):
    srv = make_server(max_batch=4)
    eng = srv.engine
    with httpx.Client(base_url=srv.url, timeout=BOUND_S) as c:
        # the session's first prompt chunk fails: its memory never took a token, so it goes on as if never asked
        assert c.post("/v1/sessions", json={"id": "s"}).status_code == 201
        faults = _Faults(eng.backend, at=[1, 4])
        monkeypatch.setattr(eng.backend, "run", faults)
        r = c.post("/v1/completions", json={"prompt": A, "max_tokens": 3, "temperature": 0, "session_id": "s"})
        assert r.status_code == 500
        assert "injected fault" in _openai_error(r.json(), "server_error", "model_error")["message"]
        info = c.get("/v1/sessions/s").json()
        assert info["state"] == "idle" and info["tokens"] == 0
        # a stream whose decode step fails mid-way: the tokens so far, then the error in OpenAI's shape
        r = c.post("/v1/completions", json={"prompt": B, "max_tokens": 10, "temperature": 0, "stream": True})
        events = _sse_events(r.text)
        assert events[-1] == "[DONE]"
        _openai_error(json.loads(events[-2]), "server_error", "model_error")
        assert faults.calls == 4
        monkeypatch.undo()
        # the engine went on: every row is back, new requests are served, the session equals one stream
        assert c.get("/health").status_code == 200
        _rows_accounted(eng)
        r = c.post("/v1/completions", json={"prompt": A, "max_tokens": 3, "temperature": 0, "session_id": "s",
                                            "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == _stream_tokens(tiny_onnx, [(A, 3)])[0]

        # a fault outside the backend call (the sampler): that request fails, the engine goes on
        class Faulty(batch_steps_module.Completion):
            def next(self, log_probs):
                if self.generated == 2:
                    raise KeyError("injected fault in the sampler")
                return super().next(log_probs)

        monkeypatch.setattr(batch_steps_module, "Completion", Faulty)
        r = c.post("/v1/completions", json={"prompt": B, "max_tokens": 5, "temperature": 0})
        assert r.status_code == 500
        assert "KeyError" in _openai_error(r.json(), "server_error", "internal_error")["message"]
        monkeypatch.undo()
        assert c.post("/v1/completions", json={"prompt": B, "max_tokens": 5}).status_code == 200
        assert eng.alive and eng.failure is None
        _rows_accounted(eng)


def test_a_broken_engine_stops_answers_every_request_and_refuses_new_ones(make_server, monkeypatch):
    srv = make_server(max_batch=1, max_queue=8)
    eng = srv.engine
    run = eng.rows.run
    inside, corrupt = threading.Event(), threading.Event()
    calls = []

    def staged(rows, tokens, positions, **kwargs):
        calls.append(len(calls) + 1)
        end = time.monotonic() + BOUND_S
        if len(calls) == 1:  # the first request's prompt: goes through once the second request is queued
            while eng.queue_depth < 1 and time.monotonic() < end:
                time.sleep(0.002)
            return run(rows, tokens, positions, **kwargs)
        inside.set()  # its first decode step: waits for two more requests to arrive meanwhile (in the inbox)
        assert corrupt.wait(BOUND_S)
        eng.rows.free.append(int(rows[0]))  # its row is now both used and free: the rows no longer add up
        raise RuntimeError("injected fault that breaks the rows")

    monkeypatch.setattr(eng.rows, "run", staged)
    body = {"prompt": B, "max_tokens": 50, "temperature": 0}

    async def clients():
        async with httpx.AsyncClient(base_url=srv.url, timeout=BOUND_S) as c:
            running = asyncio.ensure_future(c.post("/v1/completions", json=body))
            while eng.running < 1:
                await asyncio.sleep(0.005)
            waiting = asyncio.ensure_future(c.post("/v1/completions", json={**body, "stream": True}))
            while not inside.is_set():
                await asyncio.sleep(0.005)
            queued = [asyncio.ensure_future(c.post("/v1/completions", json=b))
                      for b in (body, {**body, "stream": True})]
            while eng.queue_depth < 3:
                await asyncio.sleep(0.005)
            corrupt.set()
            return await asyncio.gather(running, waiting, *queued)

    running, waiting, *queued = asyncio.run(asyncio.wait_for(clients(), BOUND_S))
    assert running.status_code == 500
    _openai_error(running.json(), "server_error", "model_error")
    for stream in (waiting, queued[1]):  # streams get the error as their last event
        events = _sse_events(stream.text)
        assert events[-1] == "[DONE]" and len(events) == 2
        _openai_error(json.loads(events[0]), "server_error", "engine_failed")
    assert queued[0].status_code == 503
    _openai_error(queued[0].json(), "server_error", "engine_failed")
    assert isinstance(eng.failure, EngineBroken) and not eng.alive
    with httpx.Client(base_url=srv.url, timeout=BOUND_S) as c:
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        for method, path, kwargs in (("POST", "/v1/completions", {"json": body}), ("POST", "/v1/sessions", {}),
                                     ("GET", "/v1/models", {})):
            r = c.request(method, path, **kwargs)
            assert r.status_code == 503, (path, r.text)
            _openai_error(r.json(), "server_error", "engine_failed")
    with pytest.raises(ApiError) as e:
        eng.submit(Job(B, _greedy(2), EventRecorder().emit))
    assert e.value.status == 503


def test_what_serve_exits_with():
    assert exit_error(None, None, True, "127.0.0.1:8000") is None  # drained and stopped: exit 0
    broken = exit_error(None, EngineBroken("the rows no longer add up"), True, "127.0.0.1:8000")
    assert isinstance(broken, EngineFailed) and broken.exit_code == 1 and "the rows no longer add up" in str(broken)
    loading = TxlError("model.onnx: not an ONNX file")
    assert exit_error(loading, None, False, "127.0.0.1:8000") is loading and loading.exit_code == 2
    assert exit_error(OSError("disk"), None, False, "x").exit_code == 2
    assert "could not listen on 127.0.0.1:8000" in str(exit_error(None, None, False, "127.0.0.1:8000"))


BROKEN_SERVE = """
import sys
from txl_deploy.cli import main
from txl_deploy.serving.rows import RowPool

def broken(self, rows, tokens, positions, head=False):
    self.free.append(int(rows[0]))  # a row both free and used: the engine's state no longer adds up
    raise RuntimeError("injected fault")

RowPool.run = broken
main(["serve", *sys.argv[1:]])
"""


def test_serve_exits_non_zero_when_its_engine_breaks(tiny_onnx, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", BROKEN_SERVE, str(tiny_onnx), "--port", str(port), "--threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    try:
        end = time.monotonic() + 2 * BOUND_S
        while time.monotonic() < end:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.05)
        r = httpx.post(url + "/v1/completions", json={"prompt": B, "max_tokens": 5}, timeout=BOUND_S)
        assert r.status_code == 500
        assert proc.wait(BOUND_S) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(BOUND_S)
    text = (tmp_path / "serve.log").read_text()
    assert "error: the engine stopped on an internal error (EngineBroken" in text, text
