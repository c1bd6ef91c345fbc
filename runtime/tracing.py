"""OpenTelemetry tracing for every duet process: one trace per request, W3C `traceparent` on
every hop (DESIGN §8).

`Tracing` is what a process holds: `Tracing.off()` (the default) costs one attribute read per
span site and imports nothing of OpenTelemetry; `setup(service, cfg)` builds an SDK
`TracerProvider` of the process's own (never the global one, so several apps in one test
process keep apart) that exports over OTLP/HTTP when an endpoint is configured, and keeps the
last `ring_size` finished spans in memory (`SpanRing`, the console's request view) when asked:
the gateway keeps its own, and a node keeps its legs' for the console to ask for
(`GET /spans?trace_id=…`, node/spans.py), so one request's timeline needs no collector.

The hops: `trace_configs()` makes an aiohttp ClientSession inject `traceparent` from the
current context into every request it sends (gateway → coordinator, gateway → P and D,
D → P's `/kv/*`); `middleware()` opens a SERVER span per request, child of the caller's
`traceparent`. Span sites use `span()` (a context manager), `start()`/`end()` (a span that
lives across an async generator's yields: it is made current only around the awaits that send
its HTTP requests, never across a yield), and `record()` (a span whose times were measured
already, e.g. the node's queue/prefill split).

Attribute names follow OTel's GenAI semantic conventions where one exists (`GEN_AI_*` below);
duet's own are under `duet.`. So do span names where the conventions name one: the gateway's
call to the model that answers (one per model tried: a fallback gives two) is an inference span
named `{gen_ai.operation.name} {gen_ai.request.model}` (`inference_span_name`), kind CLIENT;
HTTP server spans are `{method} {route}` (OTel's HTTP conventions). The steps no convention
covers (auth, route, the P and D legs, KV pull, migration, fallback) are `<process>.<step>`.

Turned on by config (`[tracing] enabled`, `--trace`) or the environment: `DUET_TRACING=1`, or
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set; `OTEL_SDK_DISABLED=true`
turns it off whatever else says on.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from aiohttp import TraceConfig, web
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.trace import Span

GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_CHOICE_COUNT = "gen_ai.request.choice.count"
#: an embeddings span's: the vector size asked for, and the encodings
GEN_AI_DIMENSIONS = "gen_ai.embeddings.dimension.count"
GEN_AI_ENCODING_FORMATS = "gen_ai.request.encoding_formats"
#: OTel's general attribute for the class of error an operation ended with (low cardinality)
ERROR_TYPE = "error.type"
#: OTel's general attributes for the peer and the HTTP status
SERVER_ADDRESS = "server.address"
HTTP_STATUS = "http.response.status_code"

TRUE = ("1", "true", "yes", "on")
#: spans the gateway keeps for its console by default (about 20 spans a request)
DEFAULT_RING = 20_000
#: spans a node keeps for the console by default (4 to 6 a leg: the last few thousand legs)
NODE_RING = 20_000
#: spans of one trace one `GET /spans` answer carries at most (a request has about 10 on a
#: node; a trace id that many requests share, from a client's own traceparent, is cut here)
MAX_TRACE_SPANS = 1000
#: deferred spans (started by one request, ended by another: P's hold) kept at most
MAX_DEFERRED = 4096

Attrs = Mapping[str, "str | int | float | bool | list[str]"]


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False
    #: OTLP/HTTP base URL (…/v1/traces is added); None: the OTEL_EXPORTER_OTLP_* environment,
    #: and no export at all when that is unset
    endpoint: str | None = None
    #: finished spans kept in memory (0: none; None: the process's default — the gateway keeps
    #: DEFAULT_RING for its console, a node NODE_RING for the console to ask for, the
    #: coordinator none)
    ring_size: int | None = None
    #: share of new traces sampled (a request that arrives with a sampled traceparent is kept)
    sample_ratio: float = 1.0


def inference_span_name(operation: str, model: str) -> str:
    """The GenAI inference span's name: `{gen_ai.operation.name} {gen_ai.request.model}`."""
    return f"{operation} {model}"


def env_enabled(environ: Mapping[str, str] | None = None) -> bool | None:
    """What the environment says: True (on), False (OTEL_SDK_DISABLED) or None (nothing)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() in TRUE:
        return False
    if env.get("DUET_TRACING", "").lower() in TRUE:
        return True
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return True
    return None


def valid_trace_id(value: str) -> bool:
    """A W3C trace id as the rings name it: 32 lower-case hex digits, not all zero."""
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value) and value != "0" * 32


def from_env(ring_size: int = 0, base: TracingConfig | None = None) -> TracingConfig:
    """`base` (a config file's section) with the environment's word on top."""
    base = base or TracingConfig()
    on = env_enabled()
    enabled = base.enabled if on is None else on
    return TracingConfig(
        enabled=enabled,
        endpoint=base.endpoint,
        ring_size=ring_size if base.ring_size is None else base.ring_size,
        sample_ratio=base.sample_ratio,
    )


class SpanRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished span as the console reads it (ids in hex, times in unix ns)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    error: bool
    attributes: dict[str, str | int | float | bool | list[str]]
    #: OTel's span kind in lower case: "server" (a request this process answered), "client" (a
    #: call it made: the model call `chat {model}`, `embeddings {model}`), "internal" (a step)
    kind: str = "internal"


def _attr_value(v: object) -> str | int | float | bool | list[str]:
    """An attribute as SpanRecord types it: OTel keeps a sequence as a tuple of str, int, float
    or bool; the record's list is of str (what the console shows, and what the wire between a
    node and the console's decoder validates)."""
    if isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, (tuple, list)):
        return [str(i) for i in v]
    return str(v)  # the SDK keeps no other kind (its type says more); a record carries a str


class SpanRing:
    """The last N finished spans of this process, by trace (an OTel SpanProcessor). It keeps
    the SDK's span objects as they end (no copy on the request's path) and converts only what
    a reader asks for."""

    def __init__(self, size: int, service: str) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=size)
        self._service = service

    # --- SpanProcessor
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    # --- reading
    def _record(self, span: ReadableSpan) -> SpanRecord:
        ctx, parent = span.context, span.parent
        return SpanRecord(
            trace_id=f"{ctx.trace_id:032x}",
            span_id=f"{ctx.span_id:016x}",
            parent_id=f"{parent.span_id:016x}" if parent is not None else None,
            name=span.name,
            service=self._service,
            start_ns=span.start_time or 0,
            end_ns=span.end_time or 0,
            error=span.status.status_code.name == "ERROR",
            kind=span.kind.name.lower(),
            attributes={k: _attr_value(v) for k, v in (span.attributes or {}).items()},
        )

    def trace(self, trace_id: str, limit: int | None = None) -> list[SpanRecord]:
        """The spans of one trace in start order; `limit`: the first that many (the newest
        spans past it are left out)."""
        tid = int(trace_id, 16)
        got = [self._record(s) for s in list(self._spans) if s.context.trace_id == tid]
        got.sort(key=lambda s: s.start_ns)
        return got if limit is None else got[:limit]

    def roots(self) -> list[SpanRecord]:
        """The spans without a parent in this process, newest first."""
        return [self._record(s) for s in reversed(list(self._spans)) if s.parent is None]

    def requests(self, limit: int = 50) -> list[SpanRecord]:
        """The request spans (those naming a `duet.request_id`), newest first."""
        out = []
        for s in reversed(list(self._spans)):
            if s.attributes and "duet.request_id" in s.attributes:
                out.append(self._record(s))
                if len(out) >= limit:
                    break
        return out

    def values(self, attribute: str) -> set[object]:
        """Every value `attribute` has in the ring, in one pass (a page asking "is this request
        traced?" for 100 rows scanned the whole ring 100 times)."""
        return {
            s.attributes[attribute]
            for s in list(self._spans)
            if s.attributes and attribute in s.attributes
        }

    def find(self, attribute: str, value: object) -> SpanRecord | None:
        s = next(
            (
                s
                for s in reversed(list(self._spans))
                if s.attributes and s.attributes.get(attribute) == value
            ),
            None,
        )
        return self._record(s) if s is not None else None


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
        import aiohttp

        propagator = self._propagator

        async def inject(_: Any, __: Any, params: aiohttp.TraceRequestStartParams) -> None:
            propagator.inject(params.headers)

        tc = aiohttp.TraceConfig()
        tc.on_request_start.append(inject)
        return [tc]

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
        from aiohttp import web
        from opentelemetry import trace
        from opentelemetry.trace import Link, SpanKind, Status, StatusCode

        tracer, propagator = self._tracer, self._propagator

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

        return [traced]

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


@contextlib.contextmanager
def timed_ns() -> Iterator[list[int]]:
    """[start_ns, end_ns] of the block in unix ns (for `record`)."""
    out = [time.time_ns(), 0]
    try:
        yield out
    finally:
        out[1] = time.time_ns()


def mono_to_unix_ns(t_mono: float) -> int:
    """A time.monotonic() reading as unix ns (spans' clock), by today's offset."""
    return time.time_ns() - int((time.monotonic() - t_mono) * 1e9)
