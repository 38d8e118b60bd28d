"""Free loopback ports for the servers this package starts (the HTTP server, local tritonservers)."""

from __future__ import annotations

import socket


def free_ports(count: int = 1, host: str = "127.0.0.1") -> list[int]:
    """`count` ports free on `host` now, all different: every socket stays bound until all are chosen (ports
    chosen one after another may repeat). Another process may still take one before the caller binds it."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            sockets.append(s)
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
