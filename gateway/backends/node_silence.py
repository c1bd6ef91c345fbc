"""A node gone silent, seen from the socket: what the gateway's connections to nodes carry so
that a peer that stopped acknowledging (cut off by a partition, its host gone) fails the call
within the connect deadline, and how such a failure is told from others.

A frozen process is not silent here: its kernel still acknowledges. That is the stall bound's
(node_client.py).
"""

from __future__ import annotations

import contextlib
import errno
import math
import socket

import aiohttp


def bound_silence(resp: aiohttp.ClientResponse, bound_s: float) -> None:
    """The connection under `resp` fails when the node's kernel leaves what was sent
    unacknowledged for `bound_s`, probed while idle (Linux: TCP_USER_TIMEOUT with keepalive):
    a node cut off mid-stream, or before the next request that reuses the connection from the
    pool, is found within the bound rather than at the read deadline. A frozen process's kernel
    still acknowledges: that is the stall bound's. Set on every response (a few syscalls), so a
    connection carries it from its first answer on."""
    if not hasattr(socket, "TCP_USER_TIMEOUT") or resp.connection is None:
        return
    transport = resp.connection.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = max(1, math.ceil(bound_s / 3))
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, math.ceil(bound_s * 1000))


def os_errno(e: BaseException) -> int | None:
    """The errno behind a failed call: an OSError's own, or the one aiohttp's connector error
    wraps (`os_error`); None when there is none."""
    err = getattr(e, "os_error", None) or (e if isinstance(e, OSError) else None)
    return getattr(err, "errno", None)


def acknowledgement_timeout(e: BaseException) -> bool:
    """The kernel gave up on the connection: the peer stopped acknowledging (ETIMEDOUT)."""
    if os_errno(e) == errno.ETIMEDOUT:
        return True
    cause = e.__cause__ or e.__context__
    return cause is not None and cause is not e and acknowledgement_timeout(cause)
