"""Running the app with uvicorn: in the foreground with graceful SIGTERM (`txl-deploy serve`), or in a thread
(`BackgroundServer`: tests and benchmarks, on 127.0.0.1 at a free port).

SIGTERM (or Ctrl-C): uvicorn stops accepting connections, the app answers 503 to new requests on open connections,
/health turns 503, running streams go on to their end for at most `drain_timeout` seconds, then the engine stops
and the process exits 0.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
import urllib.request

import uvicorn

from txl_deploy.errors import TxlError
from txl_deploy.serving.http.app import ServeSettings, create_app
from txl_deploy.serving.ports import free_port

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app to drain as soon as a signal asks it to stop."""

    def __init__(self, config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame):
        self._on_exit()
        super().handle_exit(sig, frame)


def _config(asgi, host: str, port: int, settings: ServeSettings) -> uvicorn.Config:
    return uvicorn.Config(asgi, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=int(settings.drain_timeout) + 5, server_header=False,
                          ws="none")


def _exit_quietly(signum, frame):
    # uvicorn re-raises the signal it drained on once it has finished; by then the work is done: exit 0.
    raise SystemExit(0)


def serve(load_engine, settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000):
    """Serve in the foreground until SIGTERM or Ctrl-C. Raises the loader's TxlError if the model cannot be
    loaded."""
    failure = []
    holder = {}

    def load_failed(e):
        failure.append(e)
        holder["server"].should_exit = True

    asgi = create_app(load_engine, settings, on_load_error=load_failed)
    app_state = asgi.app.state.txl
    server = _Server(_config(asgi, host, port, settings), on_exit=lambda: app_state.update(draining=True))
    holder["server"] = server
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    if failure:
        e = failure[0]
        raise e if isinstance(e, TxlError) else TxlError(f"the model could not be loaded: {e}")
    if not server.started:
        raise TxlError(f"could not listen on {host}:{port} (is the port in use?)")


class BackgroundServer:
    """The app on 127.0.0.1 at a free port in a thread: `with BackgroundServer(load_engine, settings) as srv:`
    gives srv.url once /health is 200; leaving the block drains and stops it."""

    def __init__(self, load_engine, settings: ServeSettings, host: str = "127.0.0.1", port: int | None = None,
                 ready_timeout: float = 120.0):
        self.failure = None
        self.asgi = create_app(load_engine, settings, on_load_error=self._failed)
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(_config(self.asgi, host, self.port, settings))
        self.ready_timeout = ready_timeout
        self.thread = threading.Thread(target=self.server.run, name="txl-serve-http", daemon=True)

    def _failed(self, e):
        self.failure = e
        self.server.should_exit = True

    @property
    def engine(self):
        return self.asgi.app.state.txl["engine"]

    def launch(self):
        """Start serving without waiting for the model (start() waits)."""
        if not self.thread.is_alive() and self.thread.ident is None:
            self.thread.start()
        return self

    def start(self):
        self.launch()
        end = time.monotonic() + self.ready_timeout
        while time.monotonic() < end:
            if self.failure is not None:
                self.thread.join(10)
                raise self.failure
            if not self.thread.is_alive():
                raise TxlError(f"the server on {self.url} stopped while starting")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TxlError(f"the server on {self.url} did not become ready in {self.ready_timeout:g} s")

    def drain(self):
        """What SIGTERM does: stop accepting, let running streams finish, stop."""
        self.asgi.app.state.txl["draining"] = True
        self.server.should_exit = True

    def stop(self, timeout: float = 60.0):
        self.drain()
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
