"""A bounded chaos run (about a minute) against the app on a real uvicorn socket over loopback: mixed load and the
faults a client can make (benchmarks/serve_chaos.py), then every pass criterion its own assert. The longer
run is benchmarks/serve_chaos.py."""

from __future__ import annotations

import os

from benchmarks.chaos_mix import MIX
from benchmarks.serve_chaos import ChaosSettings, Target, markdown, run_chaos
from benchmarks.serving_load import runtime_reference

KEY = "chaos-key-0123456789"
MAX_BATCH, MAX_SESSIONS, MAX_PROMPT = 8, 16, 256


def test_the_server_survives_a_minute_of_chaos(make_server, reference):
    srv = make_server({"api_key": KEY, "max_prompt_tokens": MAX_PROMPT}, max_batch=MAX_BATCH,
                      max_sessions=MAX_SESSIONS, max_queue=64)
    target = Target(srv.url, os.getpid(), MAX_BATCH, MAX_SESSIONS, max_prompt_tokens=MAX_PROMPT, api_key=KEY)
    # each golden conversation alone, in an in-process runtime
    report = run_chaos(target, ChaosSettings(duration_s=30, warmup_s=6, workers=6, golden=2, timeout_s=30, seed=3),
                       runtime_reference(reference))
    failures = report["failures"]
    why = {criterion: messages for criterion, messages in failures.items() if messages}
    assert not failures["hangs"], why  # every request answered in time, streams included
    assert not failures["server_errors"], why  # no 5xx but a documented 503
    assert not failures["answers"], why  # every answer one the API documents for what was sent
    assert not failures["rows"], why  # idle: every row free or a live session's, and all usable at once
    assert not failures["fds"], why  # descriptors back to their count after the warm-up
    assert not failures["rss"], why  # resident memory flat after the warm-up
    assert not failures["golden"], why  # the golden sessions equal one stream
    assert not failures["labels"], why  # the endpoint label set bounded by the routes
    # in this process the rows can be counted exactly (the benchmark sees them only from outside, by the probe):
    # once idle, every row is free or held by one live session, none of them twice
    free, held, busy, size = srv.engine.call(lambda: rows_of(srv.engine)).result(30)
    assert busy == (0, 0) and len(set(free)) == len(free) and len(set(held)) == len(held), (free, held, busy)
    assert not set(free) & set(held) and len(free) + len(held) == size, (free, held, size)
    # and the run did what it says: every kind of operation ran, golden sessions went through restores
    assert set(report["mix"]) == set(MIX), report["mix"]
    assert sum(g["restored"] for g in report["golden"]) >= 1 and all(g["turns"] for g in report["golden"])
    # what benchmarks/serve_chaos.py writes of such a run
    machine = {"cpus": 2, "cpu": "cpu", "system": "Linux", "load_average_start": [0.0]}
    text = markdown(report, {"label": "tiny", "server": "the app in this process", "date": "today",
                             "machine": machine, "versions": {"python": "3", "txl-deploy": "0", "onnxruntime": "1"}})
    assert "| golden sessions equal one in-process stream | yes | 0 |" in text and "**NO**" not in text
    assert all(f"| {op} | {n} |" in text for op, n in report["mix"].items())


def rows_of(engine):
    """The engine's free rows, the rows its live sessions hold, what runs and waits, and the pool's size; run in
    the engine's thread, between two steps."""
    sessions = [engine.sessions.get(sid) for sid in engine.sessions.all_ids()]
    return ([int(r) for r in engine.rows.free], [int(s.handle) for s in sessions if s.handle is not None],
            (engine.running, engine.queue_depth), engine.max_batch + engine.sessions.max_sessions)
