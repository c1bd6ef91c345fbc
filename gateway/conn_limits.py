"""The gateway's listener limits against slow and greedy clients: a cap on open connections
per client address, and a deadline for a new connection's first request headers (a client
that opens sockets and trickles bytes — slowloris — holds no descriptor past it). Idle
keep-alive connections close after `[server] keepalive_timeout_s` (aiohttp's own timer).

Invariant: a connection refused for its address is closed before a byte of it is parsed, and
every counted connection is uncounted when it is lost, however it ends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from protocol.http_errors import AppRunner, OpenAIErrorHandler, _Server
from protocol.log_throttle import ThrottledWarning

log = logging.getLogger("duet.gateway")


class _Gate:
    def __init__(self, per_address: int, header_timeout_s: float) -> None:
        self.per_address = per_address
        self.header_timeout_s = header_timeout_s
        self.open: dict[str, int] = {}
        #: a client over its cap can cause one per connection it opens: one line per 10 s
        self.refused = ThrottledWarning(log)


class _LimitedHandler(OpenAIErrorHandler):
    __slots__ = ("_address", "_deadline", "_gate")

    def __init__(self, manager: Any, *, gate: _Gate, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._address: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        gate = self._gate
        if gate.per_address and gate.open.get(address, 0) >= gate.per_address:
            gate.refused.warning("refused a connection from %s: %d open already (server.max_connections_per_address)",
                                 address, gate.open[address])  # fmt: skip
            transport.close()
            return
        gate.open[address] = gate.open.get(address, 0) + 1
        self._address = address
        super().connection_made(transport)
        if gate.header_timeout_s > 0:
            self._deadline = self._loop.call_later(gate.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._deadline = None
        if self._request_count == 0 and self.transport is not None:  # no request's headers yet
            log.info("closed a connection from %s: no request headers within %gs", self._address,
                     self._gate.header_timeout_s)  # fmt: skip
            self.force_close()
            self.transport.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._address is None:  # refused in connection_made: never counted nor started
            return
        n = self._gate.open.get(self._address, 1) - 1
        if n > 0:
            self._gate.open[self._address] = n
        else:
            self._gate.open.pop(self._address, None)
        self._address = None
        super().connection_lost(exc)


class _LimitedServer(_Server):
    gate: _Gate

    def __call__(self) -> _LimitedHandler:
        return _LimitedHandler(self, loop=self._loop, gate=self.gate, **self._kwargs)


class LimitedAppRunner(AppRunner):
    """protocol.http_errors.AppRunner (OpenAI-shaped parser errors) with the limits above."""

    __slots__ = ("_gate",)

    def __init__(self, app: web.Application, *, max_connections_per_address: int, header_timeout_s: float,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(app, **kwargs)
        self._gate = _Gate(max_connections_per_address, header_timeout_s)

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        server = _LimitedServer(base.request_handler, request_factory=base.request_factory,
                                handler_cancellation=base.handler_cancellation, loop=asyncio.get_running_loop(),
                                **base._kwargs)  # fmt: skip
        server.gate = self._gate
        return server
