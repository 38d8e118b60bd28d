"""`txl-deploy serve` on an ExecuTorch program (`.pte`): a completion sampled with a seed is the text
`TxlRuntime.generate` samples from the same program."""

from __future__ import annotations

import httpx
import pytest

from txl_deploy.cli.serve import serve as serve_command
from txl_deploy.errors import InputError
from txl_deploy.runtimes import TxlRuntime
from txl_deploy.serving.http.scheduler import Scheduler

pytest.importorskip("executorch", reason="pip install 'txl-deploy[executorch]'")

SAMPLED = {"temperature": 1.0, "seed": 42}


def test_a_completion_from_a_pte_is_generate(tiny_pte, make_server):
    with TxlRuntime.load(tiny_pte) as rt:
        ids = list(rt.generate("w1 w2 w3", 12, **SAMPLED))
        want = "".join(rt.vocab.piece(t) for t in ids)
    srv = make_server(model=tiny_pte, threads=None)  # ExecuTorch's pool is the process's: left as it is
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 12, **SAMPLED})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == want and body["usage"]["completion_tokens"] == 12


def test_a_pte_serves_with_the_cli_defaults(tiny_pte, make_server):
    """A program runs batches of at most the rows it was exported for (its memory plan); `serve`'s defaults ask
    for more (16 running requests + 64 sessions): the pool is the program's largest batch, and the sessions get
    the rows the running requests leave."""
    defaults = {p.name: p.default for p in serve_command.params}
    srv = make_server(model=tiny_pte, threads=None, max_batch=defaults["max_batch"],
                      max_sessions=defaults["max_sessions"])
    engine = srv.engine
    limit = engine.backend.max_batch
    assert defaults["max_batch"] + defaults["max_sessions"] > limit  # the case: more rows asked than it runs
    assert engine.rows.size == limit and engine.sessions.max_sessions == limit - defaults["max_batch"]
    assert httpx.post(srv.url + "/v1/sessions", json={"id": "s"}).status_code == 201
    r = httpx.post(srv.url + "/v1/completions", timeout=60,
                   json={"prompt": "w1 w2", "max_tokens": 4, "session_id": "s", **SAMPLED})
    assert r.status_code == 200, r.text


def test_a_pte_refuses_more_running_requests_than_its_batch(tiny_pte):
    with TxlRuntime.load(tiny_pte) as rt:
        limit = rt.backend.max_batch
        with pytest.raises(InputError, match=f"batches of at most {limit} rows"):
            Scheduler(rt, max_batch=limit, max_sessions=1)
