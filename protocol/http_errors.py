"""OpenAI's error body for what aiohttp's HTTP parser refuses, in every duet server.

The apps' middlewares put every error a handler raises into OpenAI's body. A request that
aiohttp's parser refuses — a request line or header over the limit, too many headers, a
malformed request line, bad chunked encoding — never reaches a handler or a middleware:
aiohttp answers it from `RequestHandler.handle_error` with a plain-text 400 and closes the
connection. aiohttp has no supported hook for that answer (aio-libs/aiohttp#3287, #6463), so
`AppRunner` here (a drop-in for `web.AppRunner`) builds its connections with a
`RequestHandler` subclass whose `handle_error` answers in OpenAI's shape. Nothing in aiohttp
is patched: other runners in the same process keep aiohttp's answer.

Invariants: the status stays aiohttp's (400 for every parser error: the C parser raises the
same `LineTooLong` for the request line and for a header, so 414 and 431 cannot be told
apart, and 400 is what aiohttp, and so every duet server before, answered); the body is
`{"error": {"message", "type", "param", "code"}}` with `Content-Type: application/json`;
the connection is closed after it (`Connection: close`), since the parser's position in the
stream is lost.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidURLError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestHandler

from protocol.openai import APIError

log = logging.getLogger("duet.http")
#: how much of aiohttp's own description a message quotes (it can repeat the client's bytes)
_DETAIL_CHARS = 200
#: aiohttp's words for the one refusal that has no exception class of its own
_TOO_MANY_HEADERS = "Too many headers received"


def parser_error(status: int, exc: BaseException | None, max_headers: int) -> APIError:
    """The OpenAI-shaped error for what aiohttp refused with `status` (400 from the parser,
    500 or 504 from a handler that raised past its middleware) and the exception it raised."""
    if status >= 500:
        what = type(exc).__name__ if exc is not None else "timeout" if status == 504 else "error"
        return APIError(status, f"internal error: {what}", type_="internal_error")
    if isinstance(exc, LineTooLong):
        # args: (the start of the line, the limit it broke, its size)
        return APIError(status, f"the request line or a header field is longer than this server accepts "
                                f"({exc.args[1]} bytes)", code="header_too_large")  # fmt: skip
    if isinstance(exc, HttpProcessingError) and exc.message == _TOO_MANY_HEADERS:
        return APIError(status, f"the request has more header fields than this server accepts ({max_headers})",
                        code="too_many_headers")  # fmt: skip
    raw = exc.message if isinstance(exc, HttpProcessingError) else str(exc or "")
    # The C parser's messages span lines, the last a caret under the offending byte: one line.
    detail = " ".join(ln.strip() for ln in raw.splitlines() if ln.strip(" ^"))[:_DETAIL_CHARS]
    if isinstance(exc, BadStatusLine):  # BadHttpMethod among them
        what = "malformed request line"
    elif isinstance(exc, InvalidURLError):
        what = "malformed request target"
    else:
        what = "malformed HTTP request"
    return APIError(status, f"{what}: {detail}" if detail else what, code="bad_request")


class OpenAIErrorHandler(RequestHandler):
    """aiohttp's connection protocol, answering its own refusals in OpenAI's error body."""

    __slots__ = ()

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:  # fmt: skip
        if request.writer.output_size > 0 or status >= 500:
            # A broken stream (aiohttp raises ConnectionError) or a handler's crash: aiohttp's
            # logging with the traceback is what an operator needs; only the body is ours.
            super().handle_error(request, status, exc, message)
        err = parser_error(status, exc, self.max_headers)
        if status < 500:
            # The client's fault: one line, not aiohttp's traceback. Non-HTTP bytes on a first
            # request (scanners, TLS on the plain port) are noise, as aiohttp also judges.
            level = logging.DEBUG if isinstance(exc, BadHttpMethod) and self._request_count == 1 else logging.INFO
            log.log(level, "refused a request from %s: %d %s", request.remote, status, err.message)
        resp = web.Response(status=status, body=msgspec.json.encode(err.body()), content_type="application/json",
                            headers={"Connection": "close"})  # fmt: skip
        resp.force_close()
        return resp


class _Server(web.Server):
    """aiohttp's low-level server, with `OpenAIErrorHandler` as each connection's protocol."""

    def __call__(self) -> RequestHandler:
        # The same construction as web.Server.__call__, with the subclass.
        return OpenAIErrorHandler(self, loop=self._loop, **self._kwargs)


class AppRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer HTTP parser errors in OpenAI's error body."""

    __slots__ = ()

    async def _make_server(self) -> web.Server:
        # BaseRunner's hook for building the server: aiohttp's own (which starts the app)
        # re-made as a _Server with the same handler, request factory and protocol kwargs.
        base = await super()._make_server()
        return _Server(base.request_handler, request_factory=base.request_factory,
                       handler_cancellation=base.handler_cancellation, loop=asyncio.get_running_loop(),
                       **base._kwargs)  # fmt: skip
