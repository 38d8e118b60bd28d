"""A WikiText-103-style word model through Triton (the bundled tritonserver, Python backend): the model config carries
the vocabulary with its tokenizer, so the Triton client, `serve-client` and `txl-deploy serve --triton` (the fleet)
tokenize a natural-text prompt with Moses and write the same detokenized text as TxlRuntime and the in-process HTTP
server, for the same seed.

The model is `helpers.word_models`' tiny random one; seeded sampling at a high temperature writes numbers, dashes
and punctuation next to each other."""

from __future__ import annotations

import functools
import json

import httpx
import pytest
from click.testing import CliRunner
from helpers.word_models import NATURAL_LINE

from txl_deploy.cli import main
from txl_deploy.runtimes import TxlRuntime

pytest.importorskip("tritonclient.grpc", reason="pip install 'tritonclient[all]'")
pytest.importorskip("torch")

SEEDS = range(3)
N = 30
SAMPLING = {"temperature": 1.5}


@pytest.fixture(scope="module")
def triton(tritonserver, wikitext_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer
    from txl_deploy.serving.triton.repository import write_repository

    repo = write_repository(wikitext_onnx, tmp_path_factory.mktemp("triton") / "repo", backend="python",
                            max_batch=2, max_sequences=4, idle_timeout=120, threads=1)
    with TritonServer(repo) as server:
        yield server


@pytest.fixture(scope="module")
def local(wikitext_onnx):
    """What TxlRuntime writes after NATURAL_LINE for a seed: (text, token ids)."""
    rt = TxlRuntime.load(wikitext_onnx, threads=1)

    @functools.cache
    def write(seed):
        rt.reset()
        ids = list(rt.generate(NATURAL_LINE, N, seed=seed, **SAMPLING))
        rt.reset()
        text = "".join(rt.generate_text(NATURAL_LINE, N, seed=seed, **SAMPLING))
        rt.reset()
        return text, ids

    yield write
    rt.close()


def test_the_triton_client_and_serve_client_write_the_runtimes_text(triton, local):
    from txl_deploy.serving.triton.client import TxlTritonClient

    client = TxlTritonClient(triton.grpc_url, timeout=120)
    try:
        assert client.vocab.tokenizer == "wikitext"  # the config's vocabulary keeps its tokenizer
        for seed in SEEDS:
            text, ids = local(seed)
            assert list(client.generate(NATURAL_LINE, max_new_tokens=N, seed=seed, **SAMPLING)) == ids
            assert "".join(client.generate_text(NATURAL_LINE, max_new_tokens=N, seed=seed, **SAMPLING)) == text
    finally:
        client.close()
    for seed in SEEDS[:2]:
        result = CliRunner().invoke(main, ["serve-client", triton.grpc_url, "--prompt", NATURAL_LINE,
                                           "--max-new-tokens", str(N), "--temperature", "1.5", "--seed", str(seed)])
        assert result.exit_code == 0, result.output
        assert result.stdout == local(seed)[0] + "\n"


def test_the_fleet_writes_the_local_servers_text(triton, wikitext_onnx, local):
    from txl_deploy.serving.http.app import ServeSettings
    from txl_deploy.serving.http.fleet import FleetEngine
    from txl_deploy.serving.http.server import BackgroundServer

    load = functools.partial(FleetEngine.connect, [triton.grpc_url], model="txl", max_batch=2, max_sessions=2,
                             max_queue=8)
    with BackgroundServer(load, ServeSettings(model_name="txl")) as fleet:
        for seed in SEEDS:
            text, ids = local(seed)
            body = {"prompt": NATURAL_LINE, "max_tokens": N, "seed": seed, "return_token_ids": True, **SAMPLING}
            r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ids and r.json()["choices"][0]["text"] == text
            streamed = httpx.post(fleet.url + "/v1/completions", json={**body, "stream": True}, timeout=120)
            pieces = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.text.splitlines()
                      if line.startswith("data: {")]
            assert "".join(pieces) == text
