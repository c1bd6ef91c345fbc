"""Tracing: what a process holds to open, end and record its spans; `setup` builds it.

`Tracing.off()` (the default) costs one attribute read per span site and imports nothing of
OpenTelemetry. `setup(service, cfg)` builds an SDK `TracerProvider` of the process's own (never
the global one, so several apps in one test process keep apart) that exports over OTLP/HTTP when
an endpoint is configured, and feeds a `SpanRing` when the config keeps spans in memory.

Span sites use `span()` (a context manager), `start()`/`end()` (a span that lives across an
async generator's yields: it is made current only around the awaits that send its HTTP
requests, never across a yield), `record()` (a span whose times were measured already, e.g. the
node's queue/prefill split) and `defer()`/`finish()` (a span one request starts and another
ends).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from runtime.tracing.config import TracingConfig
from runtime.tracing.hops import inject_traceparent, server_span
from runtime.tracing.names import Attrs
from runtime.tracing.ring import SpanRing

if TYPE_CHECKING:
    from aiohttp import TraceConfig, web
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

#: deferred spans (started by one request, ended by another: P's hold) kept at most
MAX_DEFERRED = 4096

_NOOP = contextlib.nullcontext()


class Tracing:
    """A process's tracer. Every method is cheap and does nothing when tracing is off."""

    def __init__(
        self, provider: TracerProvider | None = None, ring: SpanRing | None = None
    ) -> None:
        self.enabled = provider is not None
        self.provider = provider
        self.ring = ring
        self._tracer = provider.get_tracer("duet") if provider is not None else None
        self._deferred: OrderedDict[str, tuple[Span, float]] = OrderedDict()
        if provider is not None:
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def off(cls) -> Tracing:
        return cls()

    # --- spans
    def span(self, name: str, attributes: Attrs | None = None, *, kind: str = "INTERNAL") -> Any:
        """A context manager: a child of the current span, current inside the block (its value
        is the Span, or None when off)."""
        if self._tracer is None:
            return _NOOP
        from opentelemetry.trace import SpanKind

        return self._tracer.start_as_current_span(name, kind=SpanKind[kind], attributes=attributes)

    def start(
        self,
        name: str,
        attributes: Attrs | None = None,
        *,
        kind: str = "INTERNAL",
        parent: Span | None = None,
        start_ns: int | None = None,
    ) -> Span | None:
        """A span the caller ends with `end` (child of `parent`, else of the current span)."""
        if self._tracer is None:
            return None
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        ctx = trace.set_span_in_context(parent) if parent is not None else None
        return self._tracer.start_span(
            name, context=ctx, kind=SpanKind[kind], attributes=attributes, start_time=start_ns
        )

    @staticmethod
    def end(
        span: Span | None,
        attributes: Attrs | None = None,
        error: str | None = None,
        end_ns: int | None = None,
    ) -> None:
        if span is None:
            return
        if attributes:
            span.set_attributes(attributes)
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    @staticmethod
    def current(span: Span | None) -> Any:
        """A context manager making `span` current (for the awaits that send its requests)."""
        if span is None:
            return _NOOP
        from opentelemetry import trace

        return trace.use_span(span, end_on_exit=False)

    def record(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: Attrs | None = None,
        parent: Span | None = None,
    ) -> None:
        """A span measured already (child of `parent`, else of the current span)."""
        if self._tracer is None:
            return
        self.end(self.start(name, attributes, parent=parent, start_ns=start_ns), end_ns=end_ns)

    def annotate(self, attributes: Attrs) -> None:
        """Set attributes on the current span (the request's server span, most often)."""
        if self._tracer is None:
            return
        from opentelemetry import trace

        trace.get_current_span().set_attributes(attributes)

    def event(self, name: str, attributes: Attrs | None = None) -> None:
        if self._tracer is None:
            return
        from opentelemetry import trace

        trace.get_current_span().add_event(name, attributes)

    def defer(self, key: str, name: str, attributes: Attrs | None = None) -> None:
        """Start a span another request ends (`finish`): P's hold, from its answer to D's
        release. Bounded: the oldest is ended as it stands past MAX_DEFERRED."""
        span = self.start(name, attributes)
        if span is None:  # tracing is off
            return
        self._deferred[key] = (span, time.monotonic())
        while len(self._deferred) > MAX_DEFERRED:
            _, (span, _) = self._deferred.popitem(last=False)
            self.end(span, {"duet.outcome": "untracked"})

    def finish(self, key: str, attributes: Attrs | None = None, error: str | None = None) -> None:
        if self._tracer is None:
            return
        got = self._deferred.pop(key, None)
        if got is not None:
            self.end(got[0], attributes, error)

    def trace_id(self) -> str | None:
        """The current trace's id in hex (None when off or outside a span)."""
        if self._tracer is None:
            return None
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        return f"{ctx.trace_id:032x}" if ctx.is_valid else None

    # --- hops
    def trace_configs(self) -> list[TraceConfig]:
        """For `aiohttp.ClientSession(trace_configs=…)`: `traceparent` on every request sent."""
        if self._tracer is None:
            return []
        return [inject_traceparent(self._propagator)]

    def middleware(
        self,
        skip: tuple[str, ...] = (
            "/health",
            "/metrics",
            "/kv/events",
            "/kv/snapshot",
            "/console",
            "/cluster",
            "/spans",
        ),
        trust_parent: bool = True,
    ) -> list[Any]:
        """[] when off; else an aiohttp middleware opening a SERVER span per request. Probes,
        long-lived streams and what the console and `duet status` poll are not traced: they
        would crowd out the requests in the ring.

        `trust_parent`: the span is a child of the caller's `traceparent` (the internal plane,
        whose callers hold the cluster secret). False on a public endpoint: each request starts a
        trace of its own and keeps the client's as a span link. A client naming another
        request's trace id would otherwise put its spans into that trace, which the console
        shows to the other request's team (and the nodes' spans of it with them)."""
        if self._tracer is None:
            return []
        return [server_span(self._tracer, self._propagator, skip, trust_parent)]

    def install(
        self, app: web.Application, after: Any = None, at: int = 0, trust_parent: bool = True
    ) -> None:
        """Put `middleware()` into `app`'s chain right after `after` (else at `at`): a no-op when
        off. Called once the app's own chain is built. `trust_parent`: see `middleware`."""
        if after is not None:
            at = app.middlewares.index(after) + 1
        for m in reversed(self.middleware(trust_parent=trust_parent)):
            app.middlewares.insert(at, m)

    def shutdown(self) -> None:
        """Flush what is queued for export (at process exit)."""
        for _, (span, _) in list(self._deferred.items()):
            self.end(span, {"duet.outcome": "shutdown"})
        self._deferred.clear()
        if self.provider is not None:
            self.provider.shutdown()


def setup(service: str, cfg: TracingConfig) -> Tracing:
    """The process's Tracing: off unless `cfg.enabled`. Needs the `tracing` extra when on."""
    if not cfg.enabled:
        return Tracing.off()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    except ImportError as e:
        raise RuntimeError(
            f"tracing is on but OpenTelemetry is not installed ({e}): pip install 'duet[tracing]'"
        ) from None
    provider = TracerProvider(
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service}),
        sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
    )
    ring = None
    if cfg.ring_size:
        ring = SpanRing(cfg.ring_size, service)
        provider.add_span_processor(ring)  # type: ignore[arg-type]  # a SpanProcessor by duck type
    endpoint = cfg.endpoint
    env = os.environ
    if (
        endpoint
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = (
            OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
            if endpoint
            else OTLPSpanExporter()
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, ring)
