"""Batch-end callbacks: where they may go (SSRF checks), how they are signed, how they are sent.

A callback URL comes from a client, so it is never trusted: only http(s), no credentials in it,
and every address its host resolves to must be public unless the operator allows private ones
(`allow_private_callbacks`). When the batch is submitted only what needs no DNS is checked (a
clear 400: the scheme, credentials, the port, an address literal, `localhost`): a name is
resolved later, off the request path, before each delivery (within `DNS_TIMEOUT_S`, on threads
of its own, so a slow nameserver holds neither the request nor the gateway's other lookups),
and again inside the connector's resolver, so the address connected to is the one checked (no
DNS-rebinding gap). Redirects are not followed.

A delivery reads at most `MAX_ANSWER_BYTES` of the receiver's answer (only its status
matters), and at most `MAX_CONCURRENT` deliveries run at once per gateway.

Signature: header `X-Duet-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`
(Stripe's scheme, so receivers know it); `verify_signature` is the receiver's side.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

SIGNATURE_HEADER = "X-Duet-Signature"
#: bytes of a receiver's answer read at most (the status decides; the rest is dropped unread)
MAX_ANSWER_BYTES = 4096
#: deliveries running at once at most; the others wait for a turn
MAX_CONCURRENT = 16
#: a callback host's name must resolve within this long, or the delivery fails
DNS_TIMEOUT_S = 5.0
#: the callbacks' own resolver threads: a slow nameserver a tenant names ties up these only
_DNS = ThreadPoolExecutor(max_workers=4, thread_name_prefix="duet-callback-dns")
EVENT_HEADER = "X-Duet-Event-Id"


class CallbackURLError(ValueError):
    """A callback URL that must not be contacted."""


#: NAT64's well-known prefix (RFC 6052): its addresses carry an IPv4 address in the last 32 bits
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
#: ports a callback may use without `allow_private_callbacks`: the web's, and unprivileged ones
#: (a privileged port other than 80/443 is a service — SSH, SMTP — not a webhook receiver)
_WEB_PORTS = frozenset({80, 443})


IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _addresses(ip: IP) -> list[IP]:
    """`ip` and every IPv4 address it wraps: 6to4 (2002::/16), Teredo
    (2001::/32: its server and its client) and NAT64 (64:ff9b::/96) all reach an IPv4 host —
    a private one too, while the IPv6 address itself looks global."""
    out: list[IP] = [ip]
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.sixtofour is not None:
            out.append(ip.sixtofour)
        if ip.teredo is not None:
            out.extend(ip.teredo)
        if ip in _NAT64:
            out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out


def address_allowed(addr: str, allow_private: bool) -> bool:
    ip = ipaddress.ip_address(addr.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # the IPv4 host it is (the mapped block itself counts as reserved)
    for a in _addresses(ip):
        if a.is_multicast or a.is_unspecified or a.is_reserved:
            return False
        if not allow_private and not a.is_global:
            return False
    return True


def port_allowed(port: int, allow_private: bool) -> bool:
    return allow_private or port in _WEB_PORTS or port >= 1024


def check_url_syntax(url: str) -> tuple[str, int]:
    """(host, port) of an acceptable callback URL, or CallbackURLError."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise CallbackURLError(f"callback_url is not a valid URL: {e}") from None
    if parts.scheme not in ("http", "https"):
        raise CallbackURLError("callback_url must be an http or https URL")
    if not parts.hostname:
        raise CallbackURLError("callback_url has no host")
    if parts.username or parts.password:
        raise CallbackURLError("callback_url must not carry credentials")
    return parts.hostname, port or (443 if parts.scheme == "https" else 80)


def check_port(port: int, allow_private: bool) -> None:
    if not port_allowed(port, allow_private):
        raise CallbackURLError(
            f"callback_url port {port} is a privileged service port; use 80, 443 or a port "
            "from 1024 up"
        )


async def resolve_checked(host: str, port: int, allow_private: bool) -> list[str]:
    """Every address of `host`; raises CallbackURLError if any one is not allowed (a name that
    resolves to a public and a private address could be steered to the private one)."""
    loop = asyncio.get_running_loop()
    lookup = loop.run_in_executor(_DNS, _getaddrinfo, host, port)
    try:
        async with asyncio.timeout(DNS_TIMEOUT_S):
            infos = await lookup
    except socket.gaierror as e:
        raise CallbackURLError(
            f"callback_url host {host!r} does not resolve: {e.strerror}"
        ) from None
    except TimeoutError:
        raise CallbackURLError(
            f"callback_url host {host!r} did not resolve within {DNS_TIMEOUT_S:g} s"
        ) from None
    addrs = sorted({str(info[4][0]) for info in infos})
    bad = [a for a in addrs if not address_allowed(a, allow_private)]
    if bad or not addrs:
        raise CallbackURLError(
            f"callback_url host {host!r} resolves to a loopback, private or "
            f"reserved address ({', '.join(bad)}), which is not allowed"
        )
    return addrs


def _getaddrinfo(host: str, port: int) -> list[Any]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


def check_callback_url_now(url: str, allow_private: bool) -> None:
    """What can be checked without DNS (the request path's check): the syntax, the port, and
    the host when it is an address literal or `localhost` (RFC 6761: always loopback)."""
    host, port = check_url_syntax(url)
    check_port(port, allow_private)
    if allow_private:
        return
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        raise CallbackURLError(f"callback_url host {host!r} is a loopback name, not allowed")
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return  # a name: resolved and checked before each delivery
    if not address_allowed(host, allow_private):
        raise CallbackURLError(
            f"callback_url host {host!r} is a loopback, private or reserved address, "
            "which is not allowed"
        )


async def check_callback_url(url: str, allow_private: bool) -> None:
    """The whole check, DNS included (before each delivery)."""
    check_callback_url_now(url, allow_private)
    host, port = check_url_syntax(url)
    await resolve_checked(host, port, allow_private)


class GuardedResolver(AbstractResolver):
    """aiohttp resolver that refuses forbidden addresses at connect time."""

    def __init__(self, allow_private: bool) -> None:
        self._inner = DefaultResolver()
        self._allow_private = allow_private

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        results = await self._inner.resolve(host, port, family)
        bad = [r["host"] for r in results if not address_allowed(r["host"], self._allow_private)]
        if bad:
            raise OSError(
                f"callback host {host!r} resolves to a forbidden address ({', '.join(bad)})"
            )
        return results

    async def close(self) -> None:
        await self._inner.close()


def sign(secret: str, body: bytes, timestamp: int | None = None) -> str:
    t = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={t},v1={mac}"


def verify_signature(
    secret: str, header: str, body: bytes, tolerance_s: float = 300.0, now: float | None = None
) -> bool:
    """The receiver's check: a v1 HMAC that matches, on a timestamp within `tolerance_s`."""
    fields: dict[str, list[str]] = {}
    for part in header.split(","):
        k, _, v = part.strip().partition("=")
        fields.setdefault(k, []).append(v)
    try:
        t = int(fields["t"][0])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - t) > tolerance_s:
        return False
    expected = hmac.new(secret.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return any(hmac.compare_digest(expected, v) for v in fields.get("v1", []))


class CallbackSender:
    """POSTs signed callbacks. Owns its own ClientSession on purpose: its connector's resolver
    refuses private addresses, which the process's main session (talking to internal nodes)
    must not do."""

    def __init__(self, *, allow_private: bool, timeout_s: float) -> None:
        self._allow_private = allow_private
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._turns = asyncio.Semaphore(MAX_CONCURRENT)

    async def send(self, url: str, secret: str, body: bytes, event_id: str) -> tuple[bool, str]:
        """(delivered, detail). Delivered means a 2xx answer."""
        async with self._turns:
            return await self._send(url, secret, body, event_id)

    async def _send(self, url: str, secret: str, body: bytes, event_id: str) -> tuple[bool, str]:
        try:
            # IP literals never reach the resolver below, so check them (and names) here too.
            await check_callback_url(url, self._allow_private)
        except CallbackURLError as e:
            return False, str(e)
        if self._session is None:
            connector = aiohttp.TCPConnector(
                resolver=GuardedResolver(self._allow_private), use_dns_cache=False
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        headers: dict[str, Any] = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign(secret, body),
            EVENT_HEADER: event_id,
            "User-Agent": "duet-batch-callback/1",
        }
        try:
            async with self._session.post(
                url, data=body, headers=headers, allow_redirects=False
            ) as r:
                await r.content.read(MAX_ANSWER_BYTES)
                r.close()  # the rest unread: the connection goes, not back to the pool
                return 200 <= r.status < 300, f"HTTP {r.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            return False, f"{type(e).__name__}: {e}"

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
