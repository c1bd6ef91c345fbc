"""Deadlines for reading a request from a client, for every duet HTTP server: a client that
trickles its request — its headers (slowloris) or its body — holds no connection, no handler
and no descriptor for long. aiohttp has neither: its one timer closes a connection that is
idle between requests (`keepalive_timeout`), and a trickle of bytes, or a handler waiting on a
body, keeps the connection open for ever.

The rules, per connection:
- **Headers.** A request's headers are complete within `header_timeout_s` of the first byte of
  that request; a new connection's first request, within `header_timeout_s` of connecting. A
  keep-alive connection that sends nothing between requests is left to aiohttp's idle timer
  (`keepalive_timeout`), which may be the longer one: idle and trickling are different things.
- **Body.** A request's body arrives at a minimum average rate after a grace: its deadline is
  `body_timeout_s + received / body_min_rate_bytes_s` seconds after its headers (Apache
  mod_reqtimeout's `body=…,MinRate=…` rule). A trickler (one byte every few seconds) is cut at
  about `body_timeout_s`; a large upload keeps going as long as its average stays above the
  rate — a 200 MiB batch file needs only the rate, not a deadline guessed for its size, and a
  stall is allowed for as long as what came before paid for it. A whole-body deadline scaled by
  Content-Length was the alternative: it needs the length (a chunked upload has none) and lets
  a trickler with a large Content-Length hold the connection for that length's time.
- The clock is the client's only: while this server has stopped reading (flow control: its
  handler has not taken what came), the body's deadline is moved on, and a header deadline that
  passes while a request is being answered (a client pipelining its next request during a
  long stream) is put off, `header_timeout_s` at a time, until the answer is done — a
  deadline never cuts a response this server is writing because of its own pace.

A connection past its deadline is answered 408 in OpenAI's error body when no answer to the
request has begun, then closed; a handler still reading the body is cancelled with it. A
handler that answered without reading the whole body (a 401) leaves aiohttp draining the rest
for up to 10 s (its lingering close): the body deadline may close it sooner, without a 408.

Invariants: a connection has at most one header and one body timer; both are cancelled when
it is lost; more bytes never move a header deadline, and a body's only by the rate they pay.

A request's first bytes may come in the same read as the end of the one before (a client that
pipelines, or sends its next request early): aiohttp's parsers do not say whether they hold
part of a request, so each read's last byte is fed to the parser on its own, after the rest.
A read ends on a request's boundary exactly when that byte completes a request or its body;
when it completes nothing outside a body, the read began the next request's headers and their
deadline starts then. A parser paused by flow control (a body its handler has not read, a
full queue of pipelined requests) keeps the rest of a read unparsed: the last byte is held
here until it has parsed what it kept, then fed the same way.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import _ErrInfo

from protocol.openai import APIError
from runtime.http_errors import AppRunner, OpenAIErrorHandler, _Server

log = logging.getLogger("duet.http")


@dataclass(frozen=True)
class ReadDeadlines:
    """The rules above (0 turns a deadline off)."""

    #: a request's headers must be complete this long after its first byte (0: off)
    header_timeout_s: float = 30.0
    #: a request's body gets this long, plus 1 s per --body-min-rate-bytes-s bytes received
    #: (0: off)
    body_timeout_s: float = 30.0
    #: a body slower than this on average, after its first --body-timeout-s, is cut
    body_min_rate_bytes_s: int = 4096

    def problem(self) -> str | None:
        """What is wrong with these values, for a config error; None when they are usable."""
        for name in ("header_timeout_s", "body_timeout_s"):
            v = getattr(self, name)
            if (
                not isinstance(v, int | float)
                or isinstance(v, bool)
                or not math.isfinite(v)
                or v < 0
            ):
                return f"{name} must be a finite number of seconds >= 0 (0: no deadline), got {v!r}"
        rate = self.body_min_rate_bytes_s
        if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
            return f"body_min_rate_bytes_s must be an integer >= 1, got {rate!r}"
        return None


def _timeout_answer(message: str) -> bytes:
    """A whole HTTP/1.1 408 answer in OpenAI's error body, closing the connection."""
    body = msgspec.json.encode(APIError(408, message, code="request_timeout").body())
    head = (
        "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nContent-Length: "
        f"{len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class DeadlineHandler(OpenAIErrorHandler):
    """aiohttp's connection protocol (with OpenAI-shaped parser errors) under `ReadDeadlines`."""

    __slots__ = (
        "_body",
        "_body_bytes",
        "_body_since",
        "_body_timer",
        "_deadlines",
        "_header_timer",
        "_held",
        "_peer",
    )

    def __init__(self, manager: Any, *, deadlines: ReadDeadlines, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._deadlines = deadlines
        self._peer = "?"
        self._header_timer: asyncio.TimerHandle | None = None
        #: the body being received (None between bodies), since when, and its bytes so far
        self._body: StreamReader | None = None
        self._body_since = 0.0
        self._body_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        #: the last byte received, kept from a parser that has not parsed all it was given
        self._held = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        self._await_headers()  # a new connection owes its first request's headers

    def data_received(self, data: bytes) -> None:
        if self._force_close or self._close:  # aiohttp ignores what comes now; so do the deadlines
            super().data_received(data)
            return
        held, self._held = self._held, b""
        if self._upgraded or self._payload_parser is not None:  # no HTTP parsing: no requests
            self._feed(held + data)
            return
        if not data:  # flow control resumed: the parser first goes on with what it kept
            self._feed(b"")
            if self._stopped():
                return
        data = held + data
        if not data:
            return
        if len(data) > 1:
            self._feed(data[:-1])
            if self._stopped():
                return
        if self._reading_paused or len(self._messages) >= self._max_msg_queue_size:
            self._held = data[-1:]  # the parser stopped short of it: fed on its resume
            return
        self._feed(data[-1:])  # on its own: whether it ends a request or begins the next one

    def _stopped(self) -> bool:
        """The connection takes no more bytes: closed, closing, or its parser refused the
        request (fed more, it would refuse again, a second answer)."""
        if self.transport is None or self._force_close or self._close:
            return True
        return bool(self._messages) and isinstance(self._messages[-1][0], _ErrInfo)

    def _feed(self, data: bytes) -> None:
        """aiohttp's parsing of `data`, and the deadlines of what it began or completed."""
        if self._force_close or self._close:
            super().data_received(data)
            return
        in_body = self._body is not None
        requests = self._request_count
        super().data_received(data)
        if self.transport is None:
            return
        if self._body is not None:
            self._body_bytes += len(data)
            if self._body.is_eof():
                self._end_body()
        if self._request_count > requests:  # one or more requests' headers are complete
            self._cancel_headers()
            # The newest request is the only one whose body can still be arriving: the parser
            # stops at an incomplete body. (start() pops it later, on its own task.)
            payload = self._messages[-1][1] if self._messages else None
            if isinstance(payload, StreamReader) and not payload.is_eof() and self._body is None:
                self._start_body(payload)
        elif data and not in_body:  # the start, or more, of a request's headers
            self._await_headers()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_headers()
        self._end_body()
        super().connection_lost(exc)

    # -- headers ------------------------------------------------------------------------------

    def _await_headers(self) -> None:
        """Start the header deadline, unless it runs already (more bytes never extend it)."""
        if self._header_timer is None and self._deadlines.header_timeout_s > 0:
            self._header_timer = self._loop.call_later(
                self._deadlines.header_timeout_s, self._headers_late
            )

    def _cancel_headers(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.transport is None:
            return
        if self._current_request is not None:  # an answer is being written: the next request waits
            self._await_headers()
            return
        self._expire(
            f"the request's headers did not arrive within {self._deadlines.header_timeout_s:g} s",
            answer=True,
        )

    # -- body ---------------------------------------------------------------------------------

    def _start_body(self, payload: StreamReader) -> None:
        self._body, self._body_since, self._body_bytes = payload, self._loop.time(), 0
        if self._deadlines.body_timeout_s > 0:
            self._body_timer = self._loop.call_at(self._body_deadline(), self._body_late)

    def _end_body(self) -> None:
        self._body = None
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_deadline(self) -> float:
        d = self._deadlines
        return self._body_since + d.body_timeout_s + self._body_bytes / d.body_min_rate_bytes_s

    def _body_late(self) -> None:
        # One timer per body, moved on when it fires early, rather than one per read.
        self._body_timer = None
        if self._body is None or self.transport is None:
            return
        now = self._loop.time()
        if self._reading_paused or self._buffer_paused:
            # This server has stopped reading: the client waits on us. Its clock restarts.
            self._body_since += max(
                0.0, now + self._deadlines.body_timeout_s - self._body_deadline()
            )
        deadline = self._body_deadline()
        if now < deadline:
            self._body_timer = self._loop.call_at(deadline, self._body_late)
            return
        d = self._deadlines
        # A 408 only while the request's handler runs and has written nothing: a handler that
        # answered without reading the whole body (a 401) has had its say — aiohttp is only
        # draining the rest (lingering) — and a second answer would be one to no request.
        request = self._current_request
        self._expire(
            f"the request body arrived slower than {d.body_min_rate_bytes_s} bytes/s (after "
            f"{d.body_timeout_s:g} s; {self._body_bytes} bytes in {now - self._body_since:.0f} s)",
            answer=request is not None and request.writer.output_size == 0,
        )

    # -- both ---------------------------------------------------------------------------------

    def _expire(self, why: str, *, answer: bool) -> None:
        """Close the connection, with a 408 first when no answer to the request has begun."""
        log.info("closed a connection from %s: %s", self._peer, why)
        if answer and self.transport is not None:
            self.transport.write(_timeout_answer(why))
        self.force_close()  # closes the transport once the 408 is flushed; cancels a handler


class DeadlineServer(_Server):
    """aiohttp's low-level server whose connections are `DeadlineHandler`s."""

    deadlines: ReadDeadlines

    def __call__(self) -> DeadlineHandler:
        return DeadlineHandler(self, loop=self._loop, deadlines=self.deadlines, **self._kwargs)


class DeadlineAppRunner(AppRunner):
    """runtime.http_errors.AppRunner (OpenAI-shaped parser errors) with `ReadDeadlines`."""

    __slots__ = ("_deadlines",)
    #: the server class it builds (a subclass adds its own connection rules)
    server_class: type[DeadlineServer] = DeadlineServer

    def __init__(
        self, app: web.Application, *, deadlines: ReadDeadlines | None = None, **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self._deadlines = deadlines or ReadDeadlines()

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()
        server = self.server_class(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **base._kwargs,
        )
        server.deadlines = self._deadlines
        return server
