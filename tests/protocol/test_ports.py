"""free_port() gives ports no outgoing connection can take before a server binds them: outside
the kernel's ephemeral range (a node lost its port to one in CI), never the same one twice."""

from __future__ import annotations

import socket

from protocol.ports import _ephemeral_range, free_port


def test_free_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    lo, hi = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    for p in ports:
        assert not lo <= p <= hi, (p, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free, as promised
