"""Prometheus metrics of a coordinator replica (one registry per app, no globals).

Counters and histograms are observed where things happen; cluster gauges (index size, nodes
by role and status, leadership) are read from the live state at scrape time.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_LAG_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _ClusterCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self._snapshot()
        g = GaugeMetricFamily("duet:prefix_index_blocks", "Block hashes in the global prefix index")
        g.add_metric([], s["index_blocks"])
        yield g
        g = GaugeMetricFamily("duet:prefix_index_max_blocks", "Memory bound of the prefix index")
        g.add_metric([], s["index_max_blocks"])
        yield g
        g = GaugeMetricFamily(
            "duet:prefix_index_evictions", "Index entries dropped by the memory bound"
        )
        g.add_metric([], s["index_evictions"])
        yield g
        g = GaugeMetricFamily(
            "duet:coordinator_nodes",
            "Registered nodes by role and status",
            labels=["role", "status"],
        )
        for (role, status), n in s["nodes"].items():
            g.add_metric([role, status], n)
        yield g
        g = GaugeMetricFamily("duet:coordinator_is_leader", "1 on the leader replica")
        g.add_metric([], 1 if s["is_leader"] else 0)
        yield g
        g = GaugeMetricFamily("duet:etcd_connected", "1 while this replica's etcd watch is up")
        g.add_metric([], 1 if s["etcd_connected"] else 0)
        yield g


class CoordinatorMetrics:
    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "duet:route_decisions",
            "Routing decisions by outcome",
            ["outcome"],
            registry=self.registry,
        )
        self.route_latency = Histogram(
            "duet:route_latency_seconds",
            "Time to decide one /route",
            buckets=_ROUTE_BUCKETS,
            registry=self.registry,
        )
        self.event_lag = Histogram(
            "duet:kv_event_lag_seconds",
            "Node drain of a KV event batch → applied to the index (clock skew applies)",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        self.reuse_prompt = Counter(
            "duet:kv_reuse_prompt_tokens",
            "Prompt tokens routed (generation requests)",
            ["model"],
            registry=self.registry,
        )
        self.reuse_existed = Counter(
            "duet:kv_reuse_existed_tokens",
            "Prompt tokens whose KV some node serving the model held when routed (any tier)",
            ["model"],
            registry=self.registry,
        )
        self.reuse_routed = Counter(
            "duet:kv_reuse_routed_tokens",
            "Prompt tokens whose KV the route captured on the node computing the prompt, by "
            "where: its pool, its host or disk tier, or a peer it pulls from",
            ["model", "tier"],
            registry=self.registry,
        )
        self.resyncs = Counter(
            "duet:kv_event_resyncs",
            "Index resyncs from a node snapshot, by reason",
            ["reason"],
            registry=self.registry,
        )
        self.registry.register(_ClusterCollector(snapshot))


def count_nodes(items: list[tuple[str, str]]) -> dict[tuple[str, str], int]:
    return dict(Tally(items))
