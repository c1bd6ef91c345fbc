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
from collections.abc import Callable
from typing import Any

#: what aiohttp's TCPConnector(socket_factory=) is given: getaddrinfo's (family, type, proto,
#: canonname, sockaddr)
AddrInfo = tuple[Any, Any, int, str, tuple[Any, ...]]
SocketFactory = Callable[[AddrInfo], socket.socket]


def silent_socket_factory(bound_s: float) -> SocketFactory:
    """The socket factory of the node connections' pool: each socket fails when the node's
    kernel leaves what was sent unacknowledged for `bound_s`, probed while idle (Linux:
    TCP_USER_TIMEOUT with keepalive). Set as the socket is made, before its connect: a node cut
    off while a brand-new connection waits for its first answer is found within the bound, as is
    one cut off mid-stream or before a pooled connection's next request — rather than at the
    read deadline. A frozen process's kernel still acknowledges: that is the stall bound's."""
    idle = max(1, math.ceil(bound_s / 3))
    user_timeout_ms = math.ceil(bound_s * 1000)

    def make(addr_info: AddrInfo) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        if family in (socket.AF_INET, socket.AF_INET6) and hasattr(socket, "TCP_USER_TIMEOUT"):
            with contextlib.suppress(OSError):  # a socket without the bound still works
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, idle)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, user_timeout_ms)
        return sock

    return make


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
