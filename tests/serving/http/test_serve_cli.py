"""`txl-deploy serve` as a process: its startup log states the memory per session, SIGTERM lets a running stream
finish and exits 0 (no new connections meanwhile), and a model that cannot be loaded is a one-line error."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from click.testing import CliRunner

from txl_deploy.serving.ports import free_port

CLI = [sys.executable, "-m", "txl_deploy.cli"] if not Path(sys.executable).with_name("txl-deploy").exists() \
    else [str(Path(sys.executable).with_name("txl-deploy"))]


def _start(args, tmp_path):
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(CLI + ["serve", *args], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    return proc


def _wait_ready(url, proc, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        assert proc.poll() is None, "the server exited while starting"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server did not become ready")


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


def test_help_lists_serve_and_its_options():
    from txl_deploy.cli import main

    r = CliRunner().invoke(main, ["--help"])
    assert r.exit_code == 0 and "serve " in r.output
    r = CliRunner().invoke(main, ["serve", "--help"])
    assert r.exit_code == 0
    for option in ("--host", "--port", "--threads", "--max-batch", "--max-sessions", "--session-ttl", "--api-key",
                   "--model-name", "--triton", "--max-queue", "--max-prompt-tokens", "--max-body-bytes", "--lazy"):
        assert option in r.output, option
    assert "127.0.0.1" in r.output


def test_sigterm_drains_the_running_stream_and_exits_0(tiny_onnx, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start([str(tiny_onnx), "--port", str(port), "--threads", "1", "--max-batch", "4", "--max-sessions", "3",
                   "--drain-timeout", "60"], tmp_path)
    try:
        _wait_ready(url, proc)
        log = (tmp_path / "serve.log").read_text()
        per = re.search(r"memory per session: ([\d.,]+) MiB", log)
        assert per, log
        models = httpx.get(url + "/v1/models").json()["data"][0]
        assert models["id"] == "tiny" and f"{models['session_memory_bytes'] / 2**20:,.2f}" == per.group(1)
        n = 3000
        body = {"prompt": "w1 w2", "max_tokens": n, "temperature": 0, "stream": True, "return_token_ids": True}
        received, refused = [], False
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                received.append(line[6:])
                if len(received) == 5:
                    proc.send_signal(signal.SIGTERM)
                    end = time.monotonic() + 10  # no new connections once draining (uvicorn stops listening
                    while not refused and time.monotonic() < end:  # within a tick of its loop; poll for it)
                        try:
                            httpx.get(url + "/health", timeout=2)
                            time.sleep(0.1)
                        except httpx.TransportError:
                            refused = True
        assert received[-1] == "[DONE]"
        chunks = [json.loads(d) for d in received[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0].get("token_ids") or []) for c in chunks) == n  # every token arrived
        assert proc.wait(60) == 0
        assert refused
        log = (tmp_path / "serve.log").read_text()
        assert "Traceback" not in log
    finally:
        _stop(proc)


def test_a_model_that_cannot_be_loaded_is_a_one_line_error(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx file")
    proc = _start([str(bad), "--port", str(free_port())], tmp_path)
    try:
        assert proc.wait(120) == 2
    finally:
        _stop(proc)
    log = (tmp_path / "serve.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "bad.onnx" in errors[0], log
    assert "Traceback" not in log


def test_refuses_a_model_and_triton_together_or_neither(tiny_onnx):
    from txl_deploy.cli import main

    r = CliRunner().invoke(main, ["serve"])
    assert r.exit_code == 2 and "give a MODEL" in r.output
    r = CliRunner().invoke(main, ["serve", str(tiny_onnx), "--triton", "grpc://127.0.0.1:1"])
    assert r.exit_code == 2 and "not both" in r.output
