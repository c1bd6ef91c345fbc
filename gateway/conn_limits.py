"""The gateway's listener limits against slow and greedy clients: a cap on open connections
per client address, on top of every duet server's read deadlines (runtime/read_deadlines.py:
a request's headers within `[server] header_timeout_s` of its first byte, its body at
`body_min_rate_bytes_s` after `body_timeout_s`). Idle keep-alive connections close after
`[server] keepalive_timeout_s` (aiohttp's own timer).

An IPv6 client counts by its /64: one host is routinely given a whole /64, so a cap per full
address would be a cap per 2^64 addresses it may pick from.

Invariant: a connection refused for its address is closed before a byte of it is parsed, and
every counted connection is uncounted when it is lost, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from gateway.accounts.client_address import client_of
from runtime.log_throttle import ThrottledWarning
from runtime.read_deadlines import (
    DeadlineAppRunner,
    DeadlineHandler,
    DeadlineServer,
    ReadDeadlines,
)

log = logging.getLogger("duet.gateway")


class _Gate:
    def __init__(self, per_address: int) -> None:
        self.per_address = per_address
        self.open: dict[str, int] = {}
        #: a client over its cap can cause one per connection it opens: one line per 10 s
        self.refused = ThrottledWarning(log)


class _LimitedHandler(DeadlineHandler):
    __slots__ = ("_address", "_gate")

    def __init__(self, manager: Any, *, gate: _Gate, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._address: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = client_of(str(peer[0])) if isinstance(peer, tuple) and peer else "?"
        gate = self._gate
        if gate.per_address and gate.open.get(address, 0) >= gate.per_address:
            gate.refused.warning(
                "refused a connection from %s: %d open already "
                "(server.max_connections_per_address)",
                address,
                gate.open[address],
            )
            transport.close()
            return
        gate.open[address] = gate.open.get(address, 0) + 1
        self._address = address
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._address is None:  # refused in connection_made: never counted nor started
            return
        n = self._gate.open.get(self._address, 1) - 1
        if n > 0:
            self._gate.open[self._address] = n
        else:
            self._gate.open.pop(self._address, None)
        self._address = None
        super().connection_lost(exc)


class _LimitedServer(DeadlineServer):
    gate: _Gate

    def __call__(self) -> _LimitedHandler:
        return _LimitedHandler(
            self, loop=self._loop, gate=self.gate, deadlines=self.deadlines, **self._kwargs
        )


class LimitedAppRunner(DeadlineAppRunner):
    """runtime.read_deadlines.DeadlineAppRunner (read deadlines, OpenAI-shaped parser errors)
    with the per-address cap above."""

    __slots__ = ("_gate",)
    server_class = _LimitedServer

    def __init__(
        self,
        app: web.Application,
        *,
        max_connections_per_address: int,
        deadlines: ReadDeadlines,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, deadlines=deadlines, **kwargs)
        self._gate = _Gate(max_connections_per_address)

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        assert isinstance(server, _LimitedServer)
        server.gate = self._gate
        return server
