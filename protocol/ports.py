"""Ports for servers this project starts itself (tests, benchmarks, `duet up`, a local etcd).

Invariant: a port handed out is outside the kernel's ephemeral range, so no outgoing connection
on the machine can take it before the server binds it, and this process never hands it out
twice.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: ports free_port() handed out in this process (never twice)
_HANDED: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` free now that stays free until the caller's server binds it.

    Not one the kernel hands out itself (bind to port 0): those come from the ephemeral range,
    which every outgoing connection on the machine draws from too, and one of them took such a
    port between this check and a node's bind ("address already in use" in CI). Ports below
    (or above) that range are never given to an outgoing connection."""
    lo, hi = _ephemeral_range()
    pool = range(10_000, lo) if lo - 10_000 >= 1000 else range(hi + 1, 65_536)
    rng = random.Random()  # seeded afresh: processes forked from one parent draw different ports
    for _ in range(500):
        port = rng.choice(pool)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {pool.start}-{pool.stop - 1}")
