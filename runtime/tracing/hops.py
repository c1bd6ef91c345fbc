"""The hops of a trace: `traceparent` into every request a process sends, and a SERVER span
around every request it answers (child of the caller's `traceparent`, or on a public endpoint a
root of its own that keeps the client's as a link).

Both are built only when tracing is on (`Tracing.trace_configs`, `Tracing.middleware`), so a
process with tracing off imports nothing of OpenTelemetry.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from runtime.tracing.names import HTTP_STATUS

if TYPE_CHECKING:
    from aiohttp import TraceConfig
    from aiohttp.typedefs import Middleware
    from opentelemetry.trace import Tracer
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


def inject_traceparent(propagator: TraceContextTextMapPropagator) -> TraceConfig:
    """An aiohttp TraceConfig that writes the current context's `traceparent` into every
    request its ClientSession sends."""
    import aiohttp

    async def inject(_: Any, __: Any, params: aiohttp.TraceRequestStartParams) -> None:
        propagator.inject(params.headers)

    tc = aiohttp.TraceConfig()
    tc.on_request_start.append(inject)
    return tc


def server_span(
    tracer: Tracer,
    propagator: TraceContextTextMapPropagator,
    skip: tuple[str, ...],
    trust_parent: bool,
) -> Middleware:
    """The aiohttp middleware opening a SERVER span per request whose path does not start with
    one of `skip`; `trust_parent` as `Tracing.middleware` says."""
    from aiohttp import web
    from opentelemetry import trace
    from opentelemetry.trace import Link, SpanKind, Status, StatusCode

    @web.middleware
    async def traced(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path.startswith(skip):
            return await handler(request)
        route = request.match_info.route.resource
        name = f"{request.method} {route.canonical if route is not None else request.path}"
        ctx = propagator.extract(request.headers) if "traceparent" in request.headers else None
        links = None
        if ctx is not None and not trust_parent:
            # a root of its own (an empty context, not None: None would mean "the current
            # span"), linked to what the client said
            client = trace.get_current_span(ctx).get_span_context()
            links = [Link(client)] if client.is_valid else None
            ctx = trace.set_span_in_context(trace.INVALID_SPAN)
        with tracer.start_as_current_span(
            name,
            context=ctx,
            kind=SpanKind.SERVER,
            links=links,
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            span.set_attribute("http.request.method", request.method)
            span.set_attribute("url.path", request.path)
            try:
                resp = await handler(request)
            except web.HTTPException as e:
                span.set_attribute(HTTP_STATUS, e.status)
                raise
            except BaseException as e:
                span.set_status(Status(StatusCode.ERROR, type(e).__name__))
                raise
            span.set_attribute(HTTP_STATUS, resp.status)
            if resp.status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {resp.status}"))
            return resp

    return traced
