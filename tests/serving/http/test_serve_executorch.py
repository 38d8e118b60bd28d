"""`txl-deploy serve` on an ExecuTorch program (`.pte`): a completion sampled with a seed is the text
`TxlRuntime.generate` samples from the same program."""

from __future__ import annotations

import httpx
import pytest

from txl_deploy.runtimes import TxlRuntime

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
