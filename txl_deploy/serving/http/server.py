"""Running the app with uvicorn: in the foreground with graceful SIGTERM (`txl-deploy serve`), or in a thread
(`BackgroundServer`: tests and benchmarks, on 127.0.0.1 at a free port).

SIGTERM (or Ctrl-C): uvicorn stops accepting connections, the app answers 503 to new requests on open connections,
/health turns 503, running streams go on to their end for at most `drain_timeout` seconds, then the engine stops
and the process exits 0.

An engine that stops on an internal error (docs/serving.md: limits, errors, shutdown) has answered every request it
held; /health answers 503 and new requests get 503 while the server shuts down, and `serve` raises `EngineFailed`,
so the process exits 1 and a supervisor (systemd's Restart=on-failure, a Kubernetes pod) starts it again.
`BackgroundServer` keeps serving those 503s instead, for its caller to look at.
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


class EngineFailed(TxlError):
    """The engine stopped on an internal error while serving."""

    exit_code = 1


def exit_error(load_failure: BaseException | None, engine_failure: BaseException | None, listened: bool,
               where: str) -> TxlError | None:
    """Why `serve` ended, as the error it raises (the CLI exits with its exit_code), or None for a clean stop
    (exit 0): the model could not be loaded (2), the engine failed (1), or the address could not be bound (2)."""
    if load_failure is not None:
        if isinstance(load_failure, TxlError):
            return load_failure
        return TxlError(f"the model could not be loaded: {load_failure}")
    if engine_failure is not None:
        return EngineFailed(f"the engine stopped on an internal error ({type(engine_failure).__name__}: "
                            f"{engine_failure}); the server exited so that it can be restarted")
    if not listened:
        return TxlError(f"could not listen on {where} (is the port in use?)")
    return None


def _exit_quietly(signum, frame):
    # uvicorn re-raises the signal it drained on once it has finished; by then the work is done: exit 0.
    raise SystemExit(0)


def serve(load_engine, settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000):
    """Serve in the foreground until SIGTERM or Ctrl-C, or until the engine fails. Raises what `exit_error` says
    (the loader's TxlError if the model cannot be loaded, EngineFailed if the engine stopped on an error)."""
    failure, engine_failure = [], []
    holder = {}

    def load_failed(e):
        failure.append(e)
        holder["server"].should_exit = True

    def engine_failed(e):  # in the engine thread, once it has answered every request it held
        engine_failure.append(e)
        holder["server"].should_exit = True

    def load():
        engine = load_engine()
        engine.on_failure = engine_failed
        return engine

    asgi = create_app(load, settings, on_load_error=load_failed)
    app_state = asgi.app.state.txl
    server = _Server(_config(asgi, host, port, settings), on_exit=lambda: app_state.update(draining=True))
    holder["server"] = server
    signal.signal(signal.SIGTERM, _exit_quietly)
    try:
        server.run()
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    error = exit_error(failure[0] if failure else None, engine_failure[0] if engine_failure else None,
                       server.started, f"{host}:{port}")
    if error is not None:
        raise error


class BackgroundServer:
    """The app on 127.0.0.1 at a free port in a thread: `with BackgroundServer(load_engine, settings) as srv:`
    gives srv.url once /health is 200; leaving the block drains and stops it. An engine that fails leaves it
    running, answering 503."""

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
