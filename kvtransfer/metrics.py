"""Per-transfer accounting: bytes and seconds (DESIGN.md §4 metric names).

`KVTransferMetrics` keeps plain counters (read by tests and bench) and, when the caller
passes a `prometheus_client.CollectorRegistry`, mirrors them into
`duet:kv_transfer_bytes_total` (Counter), `duet:kv_transfer_seconds` (Histogram) and
`duet:kv_transfer_failures_total` (Counter, by reason). Never the global registry: a
process may host several nodes in tests. One instance per registry; share it between
transports of one node.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Histogram

# From one small block on one host (~50 µs) to a long prompt over a slow network.
SECONDS_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # Transfers finish on the event loop, but tests and bench read from other threads.
        self._lock = threading.Lock()
        self.transfers = 0
        self.blocks = 0
        self.bytes = 0
        self.seconds = 0.0
        self.failures: dict[str, int] = {}
        self._bytes_total: Counter | None = None
        self._seconds: Histogram | None = None
        self._failures_total: Counter | None = None
        if registry is not None:
            self._bytes_total = Counter(
                "duet:kv_transfer_bytes",
                "Bytes of KV cache received from peers",
                registry=registry,
            )
            self._seconds = Histogram(
                "duet:kv_transfer_seconds",
                "Wall time of one KV transfer (validation to last byte)",
                buckets=SECONDS_BUCKETS,
                registry=registry,
            )
            self._failures_total = Counter(
                "duet:kv_transfer_failures",
                "KV transfers that raised, by reason",
                ["reason"],
                registry=registry,
            )

    def record(self, nbytes: int, seconds: float, blocks: int = 0) -> None:
        with self._lock:
            self.transfers += 1
            self.blocks += blocks
            self.bytes += nbytes
            self.seconds += seconds
        if self._bytes_total is not None and self._seconds is not None:
            self._bytes_total.inc(nbytes)
            self._seconds.observe(seconds)

    def record_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] = self.failures.get(reason, 0) + 1
        if self._failures_total is not None:
            self._failures_total.labels(reason=reason).inc()

    @property
    def failure_count(self) -> int:
        with self._lock:
            return sum(self.failures.values())
