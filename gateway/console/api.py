"""The console's way to the gateway's own API: every read and every change goes through the
public and admin HTTP API (the same checks, limits and store paths as curl or `duet`), with
the session's key, to the address and port this request came in on — never to the store.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from aiohttp import web

from gateway.console.session import Session
from gateway.state import GatewayState

_TIMEOUT = aiohttp.ClientTimeout(total=10)


class ApiFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def own_url(request: web.Request) -> tuple[str, bool]:
    """This gateway, as reached on the socket the request came in on, and whether that socket
    speaks TLS."""
    transport = request.transport
    sock = transport.get_extra_info("sockname") if transport is not None else None
    if not sock or transport is None:
        raise ApiFailed(503, "the console cannot tell which address this gateway listens on")
    host, port = sock[0], sock[1]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    tls = transport.get_extra_info("sslcontext") is not None
    scheme = "https" if tls else "http"
    return (f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"), tls


async def call(
    state: GatewayState,
    request: web.Request,
    session: Session,
    method: str,
    path: str,
    *,
    query: dict[str, str] | None = None,
    body: Any = None,
) -> Any:
    """The API's JSON answer, or ApiFailed with its status and message."""
    base, tls = own_url(request)
    # over TLS, to this very socket by its address: its certificate names the gateway's host,
    # not the address, and the peer is this process (no verification to gain)
    async with state.session.request(
        method,
        base + path,
        params=query,
        timeout=_TIMEOUT,
        ssl=not tls,
        data=None if body is None else json.dumps(body),
        headers={
            "Authorization": f"Bearer {session.key}",
            "Content-Type": "application/json",
            # failed authentications count against the browser, not this gateway's own address
            **state.auth.clients.console_headers(request),
        },
    ) as r:
        raw = await r.read()
    try:
        data = json.loads(raw) if raw else None
    except ValueError:
        data = None
    if r.status >= 400:
        msg = (
            data["error"]["message"]
            if isinstance(data, dict) and isinstance(data.get("error"), dict)
            else raw[:200].decode(errors="replace")
        )
        raise ApiFailed(r.status, msg)
    return data
