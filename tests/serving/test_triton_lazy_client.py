"""Lazy decoding through a real tritonserver: the client fetches each step's head and only the tails its sampler
asks for, and generates exactly the tokens of the same sampler given every full distribution, greedy and seeded,
with fewer log-probs on the wire. `serve-client` decodes this way
(its greedy text is checked in test_triton_repository_and_server.py)."""

from __future__ import annotations

import pytest

from txl_deploy.serving.triton.repository import write_repository


@pytest.fixture(scope="module")
def server(tritonserver, tiny_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer

    repo = write_repository(tiny_onnx, tmp_path_factory.mktemp("lazy-triton") / "repo", backend="python",
                            max_batch=4, max_sequences=8, idle_timeout=120)
    with TritonServer(repo) as srv:
        yield srv


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
        assert lazy.lazy and not full.lazy and lazy.clusters.bounds == [(10, 30), (30, 60)]
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
