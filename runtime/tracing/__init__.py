"""OpenTelemetry tracing for every duet process: one trace per request, W3C `traceparent` on
every hop (DESIGN §8). Importers take every name from here; the modules split it by concern:

- tracer.py: `Tracing`, what a process holds (`Tracing.off()`, the default, costs one attribute
  read per span site and imports nothing of OpenTelemetry), and `setup(service, cfg)`, which
  builds an SDK `TracerProvider` of the process's own (never the global one, so several apps in
  one test process keep apart);
- config.py: `TracingConfig` and the environment's word (`DUET_TRACING`, `OTEL_*`);
- names.py: the attribute names (OTel's GenAI conventions where one exists) and span names;
- ring.py: `SpanRing`, the last finished spans kept in memory (the gateway keeps its own for
  the console's request view, and a node keeps its legs' for the console to ask for with
  `GET /spans?trace_id=…`, node/spans.py), so one request's timeline needs no collector;
  `SpanRecord`, one span as the console reads it;
- hops.py: `traceparent` into every request an aiohttp ClientSession sends (gateway →
  coordinator, gateway → P and D, D → P's `/kv/*`), and a SERVER span per request answered,
  child of the caller's `traceparent`;
- clock.py: unix-ns times for spans measured on the monotonic clock.
"""

from runtime.tracing.clock import mono_to_unix_ns, timed_ns
from runtime.tracing.config import (
    DEFAULT_RING,
    NODE_RING,
    TRUE,
    TracingConfig,
    env_enabled,
    from_env,
)
from runtime.tracing.names import (
    ERROR_TYPE,
    GEN_AI_CHOICE_COUNT,
    GEN_AI_DIMENSIONS,
    GEN_AI_ENCODING_FORMATS,
    GEN_AI_FINISH_REASONS,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_MAX_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_ID,
    GEN_AI_RESPONSE_MODEL,
    HTTP_STATUS,
    SERVER_ADDRESS,
    Attrs,
    inference_span_name,
)
from runtime.tracing.ring import MAX_TRACE_SPANS, SpanRecord, SpanRing, valid_trace_id
from runtime.tracing.tracer import MAX_DEFERRED, Tracing, setup

__all__ = [
    "DEFAULT_RING",
    "ERROR_TYPE",
    "GEN_AI_CHOICE_COUNT",
    "GEN_AI_DIMENSIONS",
    "GEN_AI_ENCODING_FORMATS",
    "GEN_AI_FINISH_REASONS",
    "GEN_AI_INPUT_TOKENS",
    "GEN_AI_MAX_TOKENS",
    "GEN_AI_OPERATION",
    "GEN_AI_OUTPUT_TOKENS",
    "GEN_AI_PROVIDER",
    "GEN_AI_REQUEST_MODEL",
    "GEN_AI_RESPONSE_ID",
    "GEN_AI_RESPONSE_MODEL",
    "HTTP_STATUS",
    "MAX_DEFERRED",
    "MAX_TRACE_SPANS",
    "NODE_RING",
    "SERVER_ADDRESS",
    "TRUE",
    "Attrs",
    "SpanRecord",
    "SpanRing",
    "Tracing",
    "TracingConfig",
    "env_enabled",
    "from_env",
    "inference_span_name",
    "mono_to_unix_ns",
    "setup",
    "timed_ns",
    "valid_trace_id",
]
