"""Prometheus metrics of the gateway (DESIGN §4 names), one registry per app (no globals)."""

from __future__ import annotations

from typing import TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)

_LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class GatewayMetrics:
    def __init__(self) -> None:
        #: label children by metric and label values (`child`)
        self._children: dict[tuple[int, tuple[str, ...]], Counter | Gauge | Histogram] = {}
        r = self.registry = CollectorRegistry()
        self.spend = Counter("duet:spend_usd", "Spend in USD", ["team", "model"], registry=r)
        self.requests = Counter(
            "duet:gateway_requests",
            "Requests finished",
            ["team", "model", "tier", "status"],
            registry=r,
        )
        self.rejections = Counter(
            "duet:ratelimit_rejections", "Requests refused by a quota", ["team", "kind"], registry=r
        )
        self.shed = Counter(
            "duet:gateway_shed",
            "Requests shed by tier admission (503)",
            ["tier", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "duet:gateway_queue_depth", "Requests waiting for admission", ["tier"], registry=r
        )
        # tier admission's refusals by team (also in `shed`, which has no team label)
        self.admission_refusals = Counter(
            "duet:gateway_admission_refusals",
            "Requests refused by tier admission (503), by team and reason",
            ["team", "tier", "reason"],
            registry=r,
        )
        # each admitted request's wait for its slot (0 when a slot was free), by team: a team
        # flooding its tier waits behind its own requests, and the others' waits show it
        self.queue_wait = Histogram(
            "duet:gateway_queue_wait_seconds",
            "Wait for a tier admission slot",
            ["team", "tier"],
            buckets=(0.0, *_LATENCY_BUCKETS),
            registry=r,
        )
        self.inflight = Gauge(
            "duet:gateway_requests_running", "Requests admitted and running", registry=r
        )
        # calls to external providers holding one of [server] max_provider_calls
        # (gateway/backends/provider_slots.py)
        self.provider_calls = Gauge(
            "duet:provider_calls_running", "Calls to external providers running", registry=r
        )
        self.ttft = Histogram(
            "duet:time_to_first_token_seconds",
            "Gateway time to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "duet:e2e_request_latency_seconds",
            "Gateway request latency",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "duet:gateway_tokens", "Tokens served", ["team", "model", "kind"], registry=r
        )
        self.retries = Counter(
            "duet:gateway_retries", "Legs retried on another node", ["kind"], registry=r
        )
        self.route_fallback = Counter(
            "duet:route_fallback", "Requests routed without a coordinator", ["reason"], registry=r
        )
        self.usage_batches = Counter(
            "duet:usage_write_batches", "Usage-record transactions", registry=r
        )
        # grammar compiles of structured-output constraints (text/guide_compile.py): one per
        # distinct guide (a resent one is answered from the cache), by verdict
        self.guide_compiles = Counter(
            "duet:guide_compiles",
            "Grammar compiles of request constraints, by verdict",
            ["verdict"],
            registry=r,
        )
        self.guide_compiling = Gauge(
            "duet:guide_compiles_running", "Grammar compiles running on their threads", registry=r
        )

    def child(self, metric: _Metric, *values: str) -> _Metric:
        """`metric.labels(*values)`, the child kept: prometheus_client's `labels` checks and
        converts its values and takes a lock on every call, several times per request on the
        request path. Children are never removed (nor are they by prometheus_client itself), so
        a cached one is the registry's own."""
        key = (id(metric), values)
        got = self._children.get(key)
        if got is None:
            got = self._children[key] = metric.labels(*values)
        return cast(_Metric, got)  # stored under its own metric's id: the same kind
