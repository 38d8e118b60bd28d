"""The browser page (txl.js in headless Chromium, onnxruntime-web) and the Triton client (a real tritonserver, Python
backend) read and write the text of a byte-level enwik8 model alike: the same ids for a non-ASCII prompt, the same
greedy text piece by piece (a character spelled over several byte tokens appears once, whole), and the same
replacement of bytes that are not UTF-8. The model is the original TensorFlow checkpoint's export (see
tests/conftest.py), whose greedy text is known in advance.

Needs chromium, an npm install of onnxruntime-web (scripts/test.sh installs both) and the bundled tritonserver
(`pip install --no-deps --target .venv/triton nvidia-pytriton==0.7.0`); skips without them unless
TXL_WEB_TESTS=required, where a missing browser fails."""

from __future__ import annotations

import asyncio
import functools
import http.server
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
from helpers import character_corpora as cc
from helpers.devtools import open_page

NPM_DIR = Path(os.environ.get("TXL_NPM_CACHE", Path.home() / ".cache" / "txl-deploy" / "npm"))
ORT_WEB_DIR = NPM_DIR / "node_modules" / "onnxruntime-web"
REQUIRED = os.environ.get("TXL_WEB_TESTS") == "required"
PROMPT = "naïve a"
N = 24  # ends on the first byte of 日: the stream's last piece is U+FFFD
INVALID = [0xE2, 0x82, 0x61, 0xC3, 0xC3, 0xA9, 0xE6, 0x97, 0x20, 0xBC]  # cut and stray sequences


def need(condition: bool, why: str):
    if not condition:
        if REQUIRED:
            pytest.fail(f"{why} (TXL_WEB_TESTS=required)")
        pytest.skip(why)


# -- the page --------------------------------------------------------------------------------------------------------
class _Quiet(http.server.SimpleHTTPRequestHandler):
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript",
                      ".js": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}

    def log_message(self, *args):
        pass


class Page:
    """The site on 127.0.0.1 (a free port), opened in headless Chromium driven over the DevTools protocol."""

    def __init__(self, site: Path, chromium: str):
        import aiohttp

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=site))
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.profile = tempfile.mkdtemp(prefix="txl-chromium-")
        self.proc = subprocess.Popen(
            [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.loop = asyncio.new_event_loop()
        self.session, self.ws, self.next_id = None, None, 0
        try:
            port = self._devtools_port()
            self.session = self.loop.run_until_complete(self._session(aiohttp))
            self.ws = self.loop.run_until_complete(self._connect(port))
            open_page(self.send, self.evaluate, f"http://127.0.0.1:{self.httpd.server_address[1]}/index.html?ep=wasm")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self) -> int:
        path = Path(self.profile, "DevToolsActivePort")
        end = time.monotonic() + 60
        while time.monotonic() < end and self.proc.poll() is None:
            if path.exists() and path.read_text().split():
                return int(path.read_text().split()[0])
            time.sleep(0.1)
        raise RuntimeError("chromium did not open its DevTools port")

    async def _session(self, aiohttp):
        return aiohttp.ClientSession()

    async def _connect(self, port):
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            target = next(t for t in await r.json() if t["type"] == "page")
        return await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)

    async def _send(self, method, params):
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def send(self, method, **params):
        return self.loop.run_until_complete(asyncio.wait_for(self._send(method, params), 300))

    def evaluate(self, expression):
        res = self.send("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            raise RuntimeError(f"page error: {d.get('exception', {}).get('description') or d.get('text')}")
        return res["result"].get("value")

    def close(self):
        try:
            if self.ws is not None:
                self.loop.run_until_complete(self.ws.close())
            if self.session is not None:
                self.loop.run_until_complete(self.session.close())
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
            self.loop.close()
            self.httpd.shutdown()
            self.httpd.server_close()
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page(tf_enwik8_onnx, tmp_path_factory):
    from txl_deploy.exporters.web.site import write_site

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    need(chromium is not None, "no chromium (apt-get install chromium)")
    need(ORT_WEB_DIR.is_dir(), f"no npm install of onnxruntime-web in {NPM_DIR}")
    pytest.importorskip("aiohttp")
    site = write_site(tf_enwik8_onnx, tmp_path_factory.mktemp("site") / "enwik8", ort_web=ORT_WEB_DIR,
                      prompt=PROMPT)
    assert json.loads((site / "vocab.json").read_text())["kind"] == "bytes"
    p = Page(site, chromium)
    yield p
    p.close()
    assert p.proc.poll() is not None


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
    end = time.monotonic() + 120
    while page.evaluate("document.body.dataset.state") != "done":
        assert time.monotonic() < end, "generation did not finish"
        time.sleep(0.2)
    assert page.evaluate("document.getElementById('status').textContent").startswith("enwik8")
    assert page.evaluate("document.getElementById('generated').textContent") == \
        cc.greedy_bytes_text(enwik8_cycle[1], PROMPT, N)
