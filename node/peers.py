"""PeerPolicy: which prefill nodes a decode node may contact for a request's KV.

A decode leg's `kv_transfer_params` name a host and port; nothing the client sends is trusted,
so before any connection:
- the address must lie in the operator's allowed networks (`--allowed-peers`, CIDR list;
  default loopback + private ranges, see node.config.DEFAULT_ALLOWED_PEERS);
- an engine id is pinned to the first address it was reached at (its metadata answered with
  that engine id): the same engine id at another address is refused, so the read and the
  release always go to the same peer.
`allowed(host, port, engine_id)` returns None or the reason to refuse. Hostnames are resolved
first (`resolve`), and every address they resolve to must be allowed.

The transport address a peer publishes in its metadata (`GET /kv/metadata`: tcp and ucx give a
host and port) is the peer's word, not the operator's: `transport_address` accepts it only when
it lies in the allowed networks *and* is the very host the leg named, and returns the checked IP
address to connect to (so a name cannot resolve elsewhere between the check and the connect).
Otherwise a "prefill" inside the allowed networks could point the decode node's transport at any
address, and the bytes read there would enter its prefix cache, poisoning it for every team.
NIXL's agent metadata is opaque (UCX worker addresses): for it, cluster membership is the check
(decode.leg, `Node.members`), and a nixl peer off this host is refused unless the operator
stated the KV network isolated (`nixl_refusal`, node/kv_network.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections import OrderedDict

from node import kv_network

#: engine ids remembered (least recently used forgotten first)
MAX_PINNED = 4096
_RESOLVE_TIMEOUT_S = 2.0

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class PeerRefused(Exception):
    """A peer this node must not read KV from (the reason in words): the client's 403."""


class PeerPolicy:
    def __init__(
        self,
        networks: tuple[Network, ...],
        max_pinned: int = MAX_PINNED,
        kv_network_isolated: bool = False,
    ) -> None:
        self.networks = networks
        self.kv_network_isolated = kv_network_isolated
        self._max = max_pinned
        self._pinned: OrderedDict[str, tuple[str, int]] = OrderedDict()

    def network_reason(self, host: str) -> str | None:
        """None if the address `host` lies in the allowed networks, else why not."""
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            return f"remote_host {host!r} is not an IP address"
        if not any(addr in net for net in self.networks):
            return f"remote_host {host} is outside this node's allowed peer networks"
        return None

    def allowed(self, host: str, port: int, engine_id: str) -> str | None:
        """None if `host` (an IP address) and `port` may be contacted for `engine_id`, else
        why not."""
        if not 0 < port < 65536:
            return f"remote_port {port} is not a TCP port"
        if (reason := self.network_reason(host)) is not None:
            return reason
        pinned = self._pinned.get(engine_id)
        if pinned is not None and pinned != (host, port):
            return f"engine {engine_id!r} is at {pinned[0]}:{pinned[1]}, not {host}:{port}"
        return None

    async def transport_address(self, published: str, named: tuple[str, ...]) -> str:
        """The IP address to connect the transport to, given the host a peer `published` in its
        metadata and the addresses of the host the leg `named`; raises PeerRefused otherwise."""
        addrs = await self.resolve(published)
        if not addrs:
            raise PeerRefused(f"its KV transport address {published!r} does not resolve")
        for a in addrs:
            if (reason := self.network_reason(a)) is not None:
                raise PeerRefused(f"its KV transport address: {reason}")
            if a not in named:
                raise PeerRefused(
                    f"its KV transport address {a} is not the host it was named by "
                    f"({', '.join(named)})"
                )
        return addrs[0]

    def nixl_refusal(self, host: str) -> str | None:
        """Why reading KV over NIXL from the peer at IP address `host` is refused (None: it is
        on this host, or the operator stated the KV network isolated)."""
        return kv_network.refusal(host, self.kv_network_isolated, "nixl", "read KV from")

    def pin(self, engine_id: str, host: str, port: int) -> None:
        """`engine_id` answered at host:port: from now on it is only reached there."""
        self._pinned[engine_id] = (host, port)
        self._pinned.move_to_end(engine_id)
        while len(self._pinned) > self._max:
            self._pinned.popitem(last=False)

    def forget(self, engine_id: str) -> None:
        self._pinned.pop(engine_id, None)

    async def resolve(self, host: str) -> list[str]:
        """The IP addresses of `host` (itself when it is one); [] if it does not resolve."""
        try:
            ipaddress.ip_address(host)
            return [host]
        except ValueError:
            pass
        if not host or len(host) > 253:
            return []
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(_RESOLVE_TIMEOUT_S):
                infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, TimeoutError, UnicodeError):
            return []
        return sorted({str(info[4][0]) for info in infos})
