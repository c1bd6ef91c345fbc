"""Ports for servers this project starts itself (tests, benchmarks, `duet up`, a local etcd).

Invariant: a port handed out is outside the kernel's ephemeral range, so no outgoing connection
on the machine can take it before the server binds it; this process never hands it out twice, and
no other process of this user on the machine gets it from free_port() within CLAIM_TTL_S: each
port handed out is claimed by a file in a per-user directory of the temp dir (parallel test
workers each start servers, and one's `duet up` lost its port to another's between the check and
its bind in CI: "Address already in use").
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
import time
from pathlib import Path

#: ports free_port() handed out in this process (never twice)
_HANDED: set[int] = set()
#: how long a port handed out to one process is not handed to another (a claim older than this
#: is taken over: its server has bound it long since, or never will)
CLAIM_TTL_S = 600.0


def _claims_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"duet-ports-{os.getuid()}"


def _claim(port: int) -> bool:
    """Claim `port` for this process across the machine; False when another process holds a live
    claim. Creating the file is atomic (O_EXCL); an expired claim is renewed in place."""
    d = _claims_dir()
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        path = d / str(port)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            if time.time() - path.stat().st_mtime < CLAIM_TTL_S:
                return False
            os.utime(path)
            return True
    except OSError:  # no usable temp dir: the bind check below still applies
        return True


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port on `host` free now that stays free until the caller's server binds it.

    Not one the kernel hands out itself (bind to port 0): those come from the ephemeral range,
    which every outgoing connection on the machine draws from too, and one of them took such a
    port between this check and a node's bind ("address already in use" in CI). Ports below
    (or above) that range are never given to an outgoing connection. Nor one that another process
    was handed within CLAIM_TTL_S (see the module docstring). `rng`: the draws (tests)."""
    lo, hi = _ephemeral_range()
    pool = range(10_000, lo) if lo - 10_000 >= 1000 else range(hi + 1, 65_536)
    rng = (
        rng or random.Random()
    )  # seeded afresh: processes forked from one parent draw different ports
    for _ in range(500):
        port = rng.choice(pool)
        if port in _HANDED:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if not _claim(port):  # free now, but another process was handed it and may bind it soon
            continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in {pool.start}-{pool.stop - 1}")
