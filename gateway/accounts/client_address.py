"""The address a request's failed authentications count under: its real client.

- A request from a peer named in `[server] trusted_proxies` (addresses or networks) counts under
  the client that proxy names: the rightmost X-Forwarded-For entry that is not itself a trusted
  proxy. Any other peer's X-Forwarded-For is ignored (anyone can write one).
- The console asks this gateway's own API over a socket (gateway/console/api.py): those calls
  come from the gateway's address, so they carry the signed-in browser's address in a header
  with a secret made at start-up and known only to this process (`console_headers`). Without
  it, a bad sign-in from anywhere counted against 127.0.0.1 and locked out every console
  session and every loopback admin call.
- `https`: whether the browser came over HTTPS (a TLS-terminating trusted proxy says so in
  X-Forwarded-Proto), so the console's cookies are Secure behind one.
- An IPv6 client counts by its /64 (`client_of`, also the connection cap's key):
  one host is routinely given a whole /64.
"""

from __future__ import annotations

import functools
import ipaddress
import secrets

from aiohttp import web

from gateway.accounts.keys import hash_secret, same_secret

#: the console's self-calls: the secret, and the browser's address it vouches for
CONSOLE_SECRET = "X-Duet-Console-Secret"
CONSOLE_CLIENT = "X-Duet-Console-Client"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@functools.lru_cache(maxsize=4096)  # a request's parse otherwise: the same few peers, again
def client_of(address: str) -> str:
    """The key a connection from `address` counts under: the address itself for IPv4 (an
    IPv4-mapped IPv6 address as its IPv4), the /64 for IPv6."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])  # a link-local zone: not the host
    except ValueError:
        return address  # not an IP (a unix socket's peer): counted as it is
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class ClientAddress:
    def __init__(self, trusted_proxies: tuple[str, ...]) -> None:
        #: checked at start-up (gateway/config_checks.py)
        self.trusted: tuple[Network, ...] = tuple(
            ipaddress.ip_network(p, strict=False) for p in trusted_proxies
        )
        self._console_secret = secrets.token_urlsafe(32)
        self._console_hash = hash_secret(self._console_secret)

    def console_headers(self, request: web.Request) -> dict[str, str]:
        """Headers for the console's call to the API on behalf of `request`'s browser."""
        return {CONSOLE_SECRET: self._console_secret, CONSOLE_CLIENT: self.of(request)}

    def of(self, request: web.Request) -> str:
        peer = request.remote or ""
        vouched = request.headers.get(CONSOLE_SECRET)
        if vouched is not None and same_secret(vouched, self._console_hash):
            return request.headers.get(CONSOLE_CLIENT, peer)
        if self.trusted and self._is_trusted(peer):
            for hop in reversed(request.headers.getall("X-Forwarded-For", [])):
                for entry in reversed(hop.split(",")):
                    entry = entry.strip()
                    if entry and not self._is_trusted(entry):
                        return client_of(entry)
        return client_of(peer)

    def https(self, request: web.Request) -> bool:
        """Whether the client reached this gateway over HTTPS: on this socket, or through a
        trusted proxy that says so (X-Forwarded-Proto; the last proxy's word counts)."""
        if request.secure:
            return True
        if not self._is_trusted(request.remote or ""):
            return False
        proto = ",".join(request.headers.getall("X-Forwarded-Proto", []))
        return proto.rsplit(",", 1)[-1].strip().lower() == "https"

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.partition("%")[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in n for n in self.trusted)
