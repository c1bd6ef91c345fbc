"""OpenAI's error body for every error a duet server answers: one middleware for every app, and
what aiohttp's HTTP parser refuses.

`error_middleware` is the one error middleware of every process (gateway, coordinator, node):
an `APIError` a handler raises, aiohttp's own refusals (404/405/413) and unexpected exceptions
(500, logged with the traceback) become OpenAI's error body with the right status and headers
(`APIError.response_headers()`: Retry-After, x-ratelimit-*), plus the request's id. A process
adds what only it knows through `translate` (the node: an overloaded or dead engine; the
gateway: a store conflict) — never a middleware of its own; a path that speaks another API's
error shape is answered by the process's `render` hook (the gateway's Anthropic paths). A client
that left is not an error: its ConnectionResetError and cancellation pass through. A request that
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
from collections.abc import Awaitable, Callable

import aiohttp
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
_ENC = msgspec.json.Encoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: what a process makes of an exception the shared middleware does not know (None: not its own)
Translate = Callable[[web.Request, BaseException], "APIError | None"]
#: the request id an error answer names (None: it names none)
RequestId = Callable[[web.Request], "str | None"]
#: the answer to an error in a shape other than OpenAI's (None: OpenAI's, `error_response`)
Render = Callable[[web.Request, APIError, "str | None"], "web.Response | None"]
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def _one_line(text: str) -> str:
    """`text` with its line breaks escaped: a client's words cannot forge a log line."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


def error_response(err: APIError, request_id: str | None = None) -> web.Response:
    """An APIError as the HTTP answer: OpenAI's body, the error's status and headers."""
    h = err.response_headers()
    if request_id is not None:
        h = {**h, "X-Request-Id": request_id}
    return web.Response(
        status=err.status, body=_ENC.encode(err.body()), content_type="application/json", headers=h
    )


def error_middleware(
    logger: logging.Logger,
    translate: Translate | None = None,
    request_id: RequestId | None = None,
    render: Render | None = None,
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The error middleware of one app (see the module's docstring). `render` answers the
    errors of the paths that speak another API's error shape (the gateway's `/v1/messages`)."""

    def _known(request: web.Request, e: BaseException) -> APIError | None:
        return translate(request, e) if translate is not None else None

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = _known(request, e) or APIError(
                e.status,
                f"{request.method} {request.path}: {e.reason}",
                code=_HTTP_CODES.get(e.status, "http_error"),
            )
        except (ConnectionResetError, aiohttp.ClientConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            known = _known(request, e)
            if known is None:
                logger.exception("unexpected error in %s %s", request.method, request.path)
                known = APIError(500, f"internal error: {type(e).__name__}", type_="internal_error")
            err = known
        # The message may quote the client (a path, a name): one log line whatever it holds.
        logger.log(
            logging.WARNING if err.status >= 500 else logging.INFO,
            "%s %r → %d: %s",
            request.method,
            request.path,
            err.status,
            _one_line(err.message),
        )
        rid = request_id(request) if request_id is not None else None
        shaped = render(request, err, rid) if render is not None else None
        return shaped if shaped is not None else error_response(err, rid)

    return errors


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
        return APIError(
            status,
            f"the request line or a header field is longer than this server accepts "
            f"({exc.args[1]} bytes)",
            code="header_too_large",
        )
    if isinstance(exc, HttpProcessingError) and exc.message == _TOO_MANY_HEADERS:
        return APIError(
            status,
            f"the request has more header fields than this server accepts ({max_headers})",
            code="too_many_headers",
        )
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

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0 or status >= 500:
            # A broken stream (aiohttp raises ConnectionError) or a handler's crash: aiohttp's
            # logging with the traceback is what an operator needs; only the body is ours.
            super().handle_error(request, status, exc, message)
        err = parser_error(status, exc, self.max_headers)
        if status < 500:
            # The client's fault: one line, not aiohttp's traceback. Non-HTTP bytes on a first
            # request (scanners, TLS on the plain port) are noise, as aiohttp also judges.
            level = (
                logging.DEBUG
                if isinstance(exc, BadHttpMethod) and self._request_count == 1
                else logging.INFO
            )
            log.log(level, "refused a request from %s: %d %s", request.remote, status, err.message)
        resp = web.Response(
            status=status,
            body=msgspec.json.encode(err.body()),
            content_type="application/json",
            headers={"Connection": "close"},
        )
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
        return _Server(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=base.handler_cancellation,
            loop=asyncio.get_running_loop(),
            **base._kwargs,
        )
