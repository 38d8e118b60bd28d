"""The browser page (txl.js in headless Chromium, onnxruntime-web) and the Triton client (a real tritonserver, Python
backend) read and write the text of a byte-level enwik8 model alike: the same ids for a non-ASCII prompt, the same
greedy text piece by piece (a character spelled over several byte tokens appears once, whole), and the same
replacement of bytes that are not UTF-8. The model is the original TensorFlow checkpoint's export (see
tests/conftest.py), whose greedy text is known in advance.

Needs chromium, an npm install of the pinned onnxruntime-web (scripts/test.sh installs both) and the bundled
tritonserver (`pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0`); skips without the browser or
onnxruntime-web unless TXL_WEB_TESTS=required, where they must be there (tests/helpers/browser.py)."""

from __future__ import annotations

import json

import pytest
from helpers import character_corpora as cc
from helpers.browser import Browser, SiteServer, chromium, ort_web

from txl_deploy.exporters.web.site import write_site

PROMPT = "naïve a"
N = 24  # ends on the first byte of 日: the stream's last piece is U+FFFD
INVALID = [0xE2, 0x82, 0x61, 0xC3, 0xC3, 0xA9, 0xE6, 0x97, 0x20, 0xBC]  # cut and stray sequences


# -- the page --------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def page(tf_enwik8_onnx, tmp_path_factory):
    exe = chromium()
    site = write_site(tf_enwik8_onnx, tmp_path_factory.mktemp("site") / "enwik8", ort_web=ort_web(),
                      prompt=PROMPT)
    assert json.loads((site / "vocab.json").read_text())["kind"] == "bytes"
    server = SiteServer(site)
    try:
        browser = Browser(exe)
        try:
            browser.open(server.url + "index.html?ep=wasm")
            yield browser
        finally:
            browser.close()
    finally:
        server.stop()
    assert browser.proc.poll() is not None  # the browser this test started is gone


# -- Triton ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def triton_client(tritonserver, tf_enwik8_onnx, tmp_path_factory):
    from txl_deploy.serving.triton.local_server import TritonServer
    from txl_deploy.serving.triton.repository import write_repository

    pytest.importorskip("tritonclient.grpc")
    from txl_deploy.serving.triton.client import TxlTritonClient

    repo = write_repository(tf_enwik8_onnx, tmp_path_factory.mktemp("triton") / "repo", backend="python",
                            max_batch=2, max_sequences=4, idle_timeout=120)
    with TritonServer(repo) as server:
        client = TxlTritonClient(server.grpc_url, timeout=120)
        yield client
        client.close()


def test_page_and_triton_client_write_the_same_text(page, triton_client, enwik8_cycle):
    want = cc.greedy_bytes_text(enwik8_cycle[1], PROMPT, N)
    assert want == "bcé€ж日 abcé€ж\ufffd"
    vocab = triton_client.vocab
    assert vocab.kind == "bytes"  # from the model's config, which carries the ONNX file's vocabulary
    assert page.evaluate(f"txlDemo.encode({json.dumps(PROMPT)})") == vocab.encode(PROMPT).tolist()

    served = list(triton_client.generate_text(PROMPT, max_new_tokens=N, temperature=0))
    shown = [piece for piece in page.evaluate(f"txlDemo.greedyText({json.dumps(PROMPT)}, {N})") if piece]
    assert served == shown == list("bcé€ж日 abcé€ж") + ["\ufffd"]

    # bytes that are not UTF-8: both replace them the same way, piece by piece
    ids = [int(vocab.byte_ids[b]) for b in INVALID]
    assert min(ids) >= 0
    decoder = vocab.stream_decoder()
    python_pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert page.evaluate(f"txlDemo.decodeStream({json.dumps(ids)})") == python_pieces
    assert "".join(python_pieces) == bytes(INVALID).decode("utf-8", "replace")


def test_the_page_shows_the_streamed_text(page, enwik8_cycle):
    page.evaluate("""(() => {
        document.getElementById('prompt').value = %s;
        document.getElementById('temperature').value = '0';
        document.getElementById('max-new').value = '%d';
        document.getElementById('generate').click();
        return true; })()""" % (json.dumps(PROMPT), N))
    page.wait_for("document.body.dataset.state === 'done'", 120, "generation did not finish")
    assert page.evaluate("document.getElementById('status').textContent").startswith("enwik8")
    assert page.evaluate("document.getElementById('generated').textContent") == \
        cc.greedy_bytes_text(enwik8_cycle[1], PROMPT, N)
