"""The browser tests' page in headless Chromium: the site on 127.0.0.1, the browser driven over the DevTools protocol.

They need Debian's `chromium` and an npm install of onnxruntime-web at the version the page pins (ORT_WEB_VERSION);
scripts/test.sh installs both where it can. Without them the tests skip, saying what is missing, unless
TXL_WEB_TESTS=required (scripts/test.sh sets it on CI and wherever it can install them), where a missing browser, a
missing onnxruntime-web or one of another version fails instead.
"""

from __future__ import annotations

import asyncio
import base64
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
from typing import ClassVar

import aiohttp
import pytest

from helpers.devtools import open_page
from txl_deploy.exporters.web.site import ORT_WEB_VERSION

NPM_DIR = Path(os.environ.get("TXL_NPM_CACHE", Path.home() / ".cache" / "txl-deploy" / "npm"))
ORT_WEB_DIR = NPM_DIR / "node_modules" / "onnxruntime-web"
REQUIRED = os.environ.get("TXL_WEB_TESTS") == "required"


def need(condition: bool, why: str) -> None:
    """Skip (or, under TXL_WEB_TESTS=required, fail) with `why` unless `condition` holds."""
    if condition:
        return
    if REQUIRED:
        pytest.fail(f"{why} (TXL_WEB_TESTS=required)")
    pytest.skip(why)


def chromium() -> str:
    """The Chromium executable on PATH."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    need(exe is not None, "no chromium on PATH (apt-get install chromium, or run scripts/test.sh as root)")
    return exe


def ort_web() -> Path:
    """The npm install of onnxruntime-web, checked to be the release the page pins: another one would test the page
    against a runtime it never loads from the CDN, and its files would not match the page's integrity hashes."""
    install = f"npm install --prefix {NPM_DIR} onnxruntime-web@{ORT_WEB_VERSION}"
    need(ORT_WEB_DIR.is_dir(), f"no npm install of onnxruntime-web in {NPM_DIR} ({install})")
    try:
        version = json.loads((ORT_WEB_DIR / "package.json").read_text(encoding="utf-8"))["version"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        version = f"an unreadable package.json ({e})"
    need(version == ORT_WEB_VERSION,
         f"{ORT_WEB_DIR} holds onnxruntime-web {version}, the page pins {ORT_WEB_VERSION} ({install})")
    return ORT_WEB_DIR


class _Handler(http.server.SimpleHTTPRequestHandler):
    # the page's module scripts and wasm load only with these types
    extensions_map: ClassVar[dict[str, str]] = {
        **http.server.SimpleHTTPRequestHandler.extensions_map, ".mjs": "text/javascript", ".js": "text/javascript",
        ".wasm": "application/wasm", ".json": "application/json", ".onnx": "application/octet-stream"}

    def log_message(self, *args):
        pass


class SiteServer:
    """A folder on 127.0.0.1 at a free port, served from a thread; stop() shuts it down."""

    def __init__(self, root: Path):
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=root))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self, executable: str):
        self.profile = tempfile.mkdtemp(prefix="txl-chromium-")
        with open(os.path.join(self.profile, "stderr.log"), "wb") as log:
            self.proc = subprocess.Popen(
                [executable, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--no-default-browser-check", "--remote-debugging-port=0",
                 f"--user-data-dir={self.profile}", "--window-size=900,700",
                 # a music page's player starts its AudioContext without a click
                 "--autoplay-policy=no-user-gesture-required",
                 # nothing but the test server resolves: the page must work offline
                 "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1", "about:blank"],
                stdout=subprocess.DEVNULL, stderr=log)
        self.loop = asyncio.new_event_loop()
        self.session, self.ws, self.next_id = None, None, 0
        try:
            port = self._devtools_port()
            self.session = self.loop.run_until_complete(self._make_session())
            self.ws = self.loop.run_until_complete(self._connect(port))
            self.send("Page.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, timeout=60) -> int:
        path = Path(self.profile, "DevToolsActivePort")
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            if path.exists() and path.read_text().split():
                return int(path.read_text().split()[0])
            time.sleep(0.1)
        err = Path(self.profile, "stderr.log").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"chromium did not start its DevTools endpoint: {err}")

    async def _make_session(self):
        return aiohttp.ClientSession()  # made inside the loop it will run on

    async def _connect(self, port):
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            target = next(t for t in await r.json() if t["type"] == "page")
        return await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)

    def send(self, method, timeout=300, **params):
        """One DevTools command; its result."""
        return self.loop.run_until_complete(asyncio.wait_for(self._send(method, params), timeout))

    async def _send(self, method, params):
        self.next_id += 1
        mid = self.next_id
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = json.loads((await self.ws.receive()).data)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression, timeout=300):
        """The value of a JavaScript expression on the page (a promise is awaited); a page error raises."""
        res = self.send("Runtime.evaluate", timeout=timeout, expression=expression, awaitPromise=True,
                        returnByValue=True)
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            raise RuntimeError(f"page error: {d.get('exception', {}).get('description') or d.get('text')}")
        return res["result"].get("value")

    def open(self, url, timeout=120):
        """Load `url` and wait for the demo page to start; the value of its `txlDemo.ready`."""
        return open_page(self.send, self.evaluate, url, timeout=timeout)

    def wait_for(self, expression, timeout, what):
        """Poll until a JavaScript expression is true; fails with `what` after `timeout` seconds."""
        end = time.monotonic() + timeout
        while not self.evaluate(expression):
            assert time.monotonic() < end, what
            time.sleep(0.2)

    def screenshot(self) -> bytes:
        return base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])

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
            shutil.rmtree(self.profile, ignore_errors=True)
