"""Free loopback ports: the ones chosen together are all different, and each can be bound."""

from __future__ import annotations

import socket

from txl_deploy.serving.ports import free_ports


def test_ports_chosen_together_differ_and_can_be_bound():
    ports = free_ports(16)
    assert len(set(ports)) == 16
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
