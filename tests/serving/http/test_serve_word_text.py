"""A WikiText-103-style word model over HTTP: `ban_unk` keeps `<unk>` out of the completion's text, as
`TxlRuntime.generate(ban_unk=True)` does, where the model would write it.

The model is `helpers.word_models`' tiny random one."""

from __future__ import annotations

import httpx
import pytest
from helpers.word_models import NATURAL_LINE, save_wikitext_model

from txl_deploy.runtimes import TxlRuntime

pytest.importorskip("torch")

SEEDS = range(6)
N = 30
SAMPLING = {"temperature": 1.5, "max_tokens": N}


@pytest.fixture(scope="module")
def wikitext_onnx(tmp_path_factory):
    from txl_deploy.exporters.onnx.export import export_onnx

    root = tmp_path_factory.mktemp("wikitext")
    return export_onnx(save_wikitext_model(root / "wt"), root / "wt.onnx", max_segment=16, verify=False).path


@pytest.fixture(scope="module")
def rt(wikitext_onnx):
    with TxlRuntime.load(wikitext_onnx, threads=1) as runtime:
        yield runtime


def _text(rt, seed, **controls):
    """What TxlRuntime writes after NATURAL_LINE: (text, token ids)."""
    rt.reset()
    ids = list(rt.generate(NATURAL_LINE, N, temperature=1.5, seed=seed, **controls))
    rt.reset()
    return "".join(rt.stream_decoder(NATURAL_LINE).pieces(ids)), ids


def _check_ban_unk(url, rt):
    unk = rt.vocab.index["<unk>"]
    for seed in SEEDS[:3]:
        body = {"prompt": NATURAL_LINE, "seed": seed, "logit_bias": {str(unk): 100}, "return_token_ids": True,
                **SAMPLING}
        free = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]
        assert free["token_ids"] == [unk] * N  # what the model would write
        banned = httpx.post(url + "/v1/completions", json={**body, "ban_unk": True}, timeout=120).json()
        want, ids = _text(rt, seed, logit_bias={unk: 100}, ban_unk=True)
        assert banned["choices"][0]["token_ids"] == ids and unk not in ids
        assert banned["choices"][0]["text"] == want and "<unk>" not in want


def test_ban_unk_keeps_unk_out_of_completions(make_server, wikitext_onnx, rt):
    _check_ban_unk(make_server(model=wikitext_onnx).url, rt)
