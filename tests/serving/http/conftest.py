"""A running `txl-deploy serve` app for the HTTP tests: on 127.0.0.1 at a free port, in a thread, over the tiny
ONNX model; every server a test starts is stopped (and shown to be gone) when it is done with."""

from __future__ import annotations

import functools

import httpx
import pytest
from helpers import conversations

pytest.importorskip("fastapi", reason="pip install 'txl-deploy[serve]'")

from txl_deploy.serving.http.app import ServeSettings  # noqa: E402
from txl_deploy.serving.http.scheduler import Scheduler  # noqa: E402
from txl_deploy.serving.http.server import BackgroundServer  # noqa: E402


def start_server(model, settings: dict | None = None, **engine):
    options = dict(max_batch=8, max_sessions=8, max_queue=32, threads=1)
    options.update(engine)
    load = functools.partial(Scheduler.load, model, **options)
    return BackgroundServer(load, ServeSettings(**{"model_name": "tiny", **(settings or {})})).start()


@pytest.fixture
def make_server(tiny_onnx):
    """start(settings=None, **engine options) -> a started BackgroundServer, stopped after the test."""
    started = []

    def start(settings=None, model=None, **engine):
        srv = start_server(model or tiny_onnx, settings, **engine)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()
        assert not srv.thread.is_alive()
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health", timeout=2)


@pytest.fixture(scope="module")
def server(tiny_onnx):
    """One server for a test module: 32 rows, so 32 streams run at once; prompts of at most 256 tokens."""
    srv = start_server(tiny_onnx, {"max_prompt_tokens": 256}, max_batch=32, max_sessions=8, max_queue=64)
    yield srv
    srv.stop()
    assert not srv.thread.is_alive()


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def alone(reference):
    return functools.partial(conversations.alone, reference)
