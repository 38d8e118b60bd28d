"""Driving a serving engine directly: holding it at a chosen backend call, so a test knows exactly what the engine
has made when it acts, and recording what it sends a job."""

from __future__ import annotations

import threading


class EngineGate:
    """The engine's `which`-th backend call (counting only decode calls, of one token per row, with decode_only)
    waits until `open()`; `held` is set once it waits. Before the k-th decode call of a lone stream, k of its
    tokens are out (its prompt call made the first). `close()` opens the gate and puts the engine's call back."""

    def __init__(self, engine, which: int = 1, decode_only: bool = False, timeout: float = 60.0):
        self.engine, self.which, self.decode_only, self.timeout = engine, which, decode_only, timeout
        self.held, self._opened = threading.Event(), threading.Event()
        self.calls = 0
        self._run = engine.rows.run
        engine.rows.run = self._gated

    def _gated(self, *args, **kwargs):
        tokens = args[1]
        if not self.decode_only or tokens.shape[1] == 1:
            self.calls += 1
            if self.calls == self.which:
                self.held.set()
                self._opened.wait(self.timeout)
        return self._run(*args, **kwargs)

    def open(self):
        self._opened.set()

    def close(self):
        self.open()
        self.engine.rows.run = self._run

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class EventRecorder:
    """A job's `emit`: the events the engine sends it, in order; `done` is set by its last (done or error)."""

    def __init__(self):
        self.events = []
        self.done = threading.Event()

    def emit(self, kind, payload):
        self.events.append((kind, payload))
        if kind != "token":
            self.done.set()

    @property
    def tokens(self):
        return [p.token for k, p in self.events if k == "token"]
