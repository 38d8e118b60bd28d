"""Lazy decoding through a real tritonserver: the client fetches each step's head and only the tails its sampler
asks for, and generates exactly the tokens of the same sampler given every full distribution, greedy and seeded,
with fewer log-probs on the wire; the model runs the head graph for those steps and only the tails asked for (its
custom metrics say so). `serve-client` decodes this way
(its greedy text is checked in test_triton_repository_and_server.py)."""

from __future__ import annotations

import re
import urllib.request

import pytest

from txl_deploy.serving.ports import free_port
from txl_deploy.serving.triton.repository import write_repository


@pytest.fixture(scope="module")
def server(tritonserver, tiny_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer

    repo = write_repository(tiny_onnx, tmp_path_factory.mktemp("lazy-triton") / "repo", backend="python",
                            max_batch=4, max_sequences=8, idle_timeout=120)
    port = free_port()
    with TritonServer(repo, extra_args=["--allow-metrics=true", "--allow-gpu-metrics=false",
                                        "--allow-cpu-metrics=false", f"--metrics-port={port}"]) as srv:
        srv.metrics_url = f"http://127.0.0.1:{port}/metrics"
        yield srv


def runs(server) -> dict:
    """The model's custom metrics: rows run through each graph ("full", "head") and each tail cluster (1, 2)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for name, labels, value in re.findall(r"^(txl_deploy_\w+)\{([^}]*)\} (\S+)$", text, re.MULTILINE):
        key = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[key.get("graph") or int(key["cluster"])] = int(float(value))
    return out


def reference_tokens(tiny_onnx, prompt, n, params):
    """The tokens of the sampler with the model's clusters, given each step's full distribution (in-process)."""
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.runtimes.sampling import Clusters, Sampler

    with TxlRuntime.load(tiny_onnx) as rt:
        clusters = Clusters.of(rt.config)
        sampler = Sampler(params, rt.n_token, context=prompt, vocab=rt.vocab, clusters=clusters)
        lp = rt.step([prompt])[0, -1]
        out = []
        for _ in range(n):
            tok = sampler.choose(lp)
            out.append(tok)
            if sampler.stopped_by_token(tok):
                break
            lp = rt.step([[tok]])[0, -1]
    return out


@pytest.mark.parametrize("controls", [
    dict(temperature=0.0),
    dict(temperature=1.0, seed=3),
    dict(temperature=0.7, top_k=8, seed=5),
    dict(temperature=1.3, top_p=0.9, min_p=0.05, seed=11, repetition_penalty=1.3),
    dict(temperature=0.9, seed=2, logit_bias={45: 5.0}, presence_penalty=-1.0),
])
def test_lazy_client_generates_the_full_paths_tokens(server, tiny_onnx, controls):
    from txl_deploy.runtimes.sampling import SamplingParams
    from txl_deploy.serving.triton.client import TxlTritonClient

    prompt = [5, 17, 42, 3, 9]
    n = 12
    lazy = TxlTritonClient(server.grpc_url, timeout=120, lazy=True)
    full = TxlTritonClient(server.grpc_url, timeout=120)
    try:
        assert lazy.lazy and not full.lazy and lazy.clusters.bounds == ((10, 30), (30, 60))
        with lazy.conversation() as conv:
            got = list(conv.generate(prompt, max_new_tokens=n, **controls))
            received = conv.received
        params = SamplingParams(max_tokens=n, **controls)
        assert got == reference_tokens(tiny_onnx, prompt, n, params)
        with full.conversation() as conv:
            assert len(list(conv.generate(prompt, max_new_tokens=n, **controls))) == len(got)
            # per step the head (12 values) and the tails asked for, against 60: at worst the 2 cluster columns more
            # (this tiny model's tails are 50 of its 60 words; WikiText-103's are 247,732 of 267,735)
            assert received <= conv.received + 2 * (len(got) + 1)
            if controls["temperature"] == 0:
                assert received < conv.received
    finally:
        lazy.close()
        full.close()


@pytest.mark.parametrize("controls", [dict(temperature=0.0), dict(temperature=1.0, seed=3),
                                      dict(temperature=1.0, top_k=8, seed=5)])
def test_lazy_generation_is_the_runtimes_and_the_server_skips_the_tails_not_asked_for(server, tiny_onnx, controls):
    from txl_deploy.runtimes import TxlRuntime
    from txl_deploy.serving.triton.client import TxlTritonClient

    prompt, n = [5, 17, 42, 3, 9], 40
    with TxlRuntime.load(tiny_onnx) as rt:
        want = list(rt.generate(prompt, max_new_tokens=n, **controls))
    client = TxlTritonClient(server.grpc_url, timeout=120, lazy=True)
    try:
        before = runs(server)
        asked = []
        with client.conversation() as conv:
            fetch = conv._tails
            conv._tails = lambda clusters: (asked.extend(clusters), fetch(clusters))[1]  # what the sampler asked
            got = list(conv.generate(prompt, max_new_tokens=n, **controls))
        after = runs(server)
        assert got == want
        # every step ran the head graph (the prompt, each token fed, the last one with the end), never the full
        # one, and each tail graph ran exactly as often as the client asked for that tail
        assert after["head"] - before["head"] == len(got) + 1 and after["full"] == before["full"]
        assert [after[i] - before[i] for i in (1, 2)] == [asked.count(1), asked.count(2)]
        assert len(asked) < 2 * len(got)  # some decisions needed no tail at all
    finally:
        client.close()
