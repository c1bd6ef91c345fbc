"""Whether this node may exchange KV over NIXL with a peer: only on its own host, unless the
operator states that the KV network is isolated (`--kv-network-isolated`).

NIXL moves KV as one-sided UCX reads: the owner of a pool runs no code when it is read, so
nothing can check the reader, and the bytes cross in clear. Whoever reaches a node's UCX worker
with its memory keys reads every team's KV there. Between machines that is safe only on a
network that nothing but the cluster's nodes reaches, which duet cannot see: the operator says
so. Until then a nixl node refuses, both ways, a peer that is not on its own host:
- as a reader, before it adds the peer (node/remote_kv.py, node/engines/vllm_legs.py);
- as an owner, before it hands out its metadata, which carries the memory keys (node/app.py).
The tcp and ucx transports need no statement: their handshake proves the cluster secret.

"Own host" is decided by the kernel, not by names: an address is this host's when a socket can
bind to it (loopback, or an address of one of this network namespace's interfaces). Two
namespaces on one machine are two hosts here, as they are to the network.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket

log = logging.getLogger("duet.node")

#: the statement's flag, named by every refusal
FLAG = "--kv-network-isolated"
#: the error code of a refusal (the client's 403)
CODE = "kv_network_not_isolated"


def is_own_address(host: str) -> bool:
    """Whether the IP address `host` is this host's: loopback, or one a socket here can bind."""
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    if addr.is_loopback:
        return True
    if addr.is_unspecified or addr.is_multicast:
        return False
    family = socket.AF_INET6 if addr.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((str(addr), 0))
    except OSError as e:
        if e.errno not in (errno.EADDRNOTAVAIL, errno.EINVAL):
            log.warning("cannot tell whether %s is this host's address: %s", addr, e)
        return False
    return True


def refusal(host: str, isolated: bool, backend: str, role: str) -> str | None:
    """Why a nixl exchange with the peer at IP address `host` is refused (None: allowed).
    `role` says what the peer does: "read KV from" or "hand KV metadata to"."""
    if backend != "nixl" or isolated or is_own_address(host):
        return None
    return (
        f"refusing to {role} {host}: it is not on this host, and NIXL moves KV unauthenticated "
        f"and unencrypted (a one-sided read cannot be checked by the pool's owner). Start both "
        f"nodes with {FLAG} if only the cluster's nodes reach the KV network, or use "
        f"--transport tcp or ucx (their handshake needs the cluster secret)"
    )


def log_startup(backend: str, isolated: bool) -> None:
    """One line at start that says which peers a nixl node will exchange KV with."""
    if backend != "nixl":
        return
    if isolated:
        log.info("KV network stated isolated (%s): NIXL peers on other hosts are accepted", FLAG)
    else:
        log.info(
            "NIXL exchanges KV with nodes on this host only; peers on other hosts are refused "
            "unless the KV network is isolated and the node runs with %s",
            FLAG,
        )
