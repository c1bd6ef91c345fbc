"""The Prometheus metrics duet's processes export, read from the code itself.

`exported()` builds every metrics object of a gateway, a coordinator (with its planner), a node
(with its KV transport and registration) and collects their registries: family name → type.
`sample_names()` expands that into the series names Prometheus stores (a counter `x` is scraped
as `x_total` and `x_created`, a histogram as `x_bucket`, `x_sum`, `x_count`, ...), the names a
dashboard or an alert rule may use.

`declared_in_source()` is the guard that keeps `exported()` complete: every metric name that a
constructor call in the service packages declares must be among what `exported()` collected, so
a new metrics module cannot be left out of the check.
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
#: the packages whose processes Prometheus scrapes
SERVICE_PACKAGES = ("gateway", "coordinator", "node", "prefill", "decode", "kvtransfer", "planner")
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}
_DECLARED = re.compile(
    r"""(?:Counter|Gauge|Histogram|Summary|Info|Enum|\w+MetricFamily)\(\s*\n?\s*"(duet:[a-z0-9_:]+)\""""
)
#: node/metrics.py's tables of engine gauges and counters: `"duet:name": ("stat key", "doc")`
_TABLE_ENTRY = re.compile(r"""^\s*"(duet:[a-z0-9_:]+)":\s*\(""", re.M)


def _registries() -> list[CollectorRegistry]:
    from coordinator.metrics import CoordinatorMetrics
    from gateway.backends.providers.metrics import register_provider_metrics
    from gateway.metrics import GatewayMetrics
    from kvtransfer.metrics import KVTransferMetrics
    from node.metrics import NodeMetrics
    from node.registration import DrainHooks, Registration
    from planner.metrics import PlannerMetrics
    from protocol.cluster import NodeInfo

    gateway = GatewayMetrics()
    register_provider_metrics(gateway.registry, lambda: [])
    snapshot = {
        "index_blocks": 0,
        "index_max_blocks": 1,
        "index_evictions": 0,
        "nodes": {},
        "is_leader": False,
        "etcd_connected": True,
    }
    coordinator = CoordinatorMetrics(lambda: snapshot)
    PlannerMetrics(coordinator.registry)
    node = NodeMetrics(lambda: {}, "model", "prefill")
    KVTransferMetrics(node.registry)
    info = NodeInfo(
        node_id="n",
        role="prefill",
        url="http://127.0.0.1:1",
        model="m",
        engine_id="e",
        block_size=16,
        kv_layout_hash="h",
        kv_capacity_blocks=1,
        max_model_len=1,
        started_at=0.0,
    )
    hooks = DrainHooks(is_busy=lambda: False, shutting_down=lambda: False)
    Registration(None, info, "c", 10, hooks, registry=node.registry)  # type: ignore[arg-type]  # no I/O before attach
    return [gateway.registry, coordinator.registry, node.registry]


def exported() -> dict[str, str]:
    """Every metric family the processes export: name (as registered) → Prometheus type."""
    families: dict[str, str] = {}
    for registry in _registries():
        for family in registry.collect():
            families[family.name] = family.type
    return families


def sample_names(families: dict[str, str]) -> set[str]:
    return {name + suffix for name, kind in families.items() for suffix in _SUFFIXES[kind]}


def declared_in_source() -> dict[str, Path]:
    """Metric names the service packages declare in a metrics constructor (name → file)."""
    found: dict[str, Path] = {}
    for package in SERVICE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            names = _DECLARED.findall(text) + (
                _TABLE_ENTRY.findall(text) if path.name == "metrics.py" else []
            )
            for name in names:
                found.setdefault(name, path)
    return found


#: Grafana's own variables, and the dashboard's (always inside a label matcher's regex)
_GRAFANA_RANGES = re.compile(r"\$__(?:rate_interval|interval|range)\b")
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")
_LABEL_VALUES = re.compile(r"^label_values\((.+),\s*\w+\)$")


def used_in(expr: str) -> set[str]:
    """The metric names a PromQL expression reads, from its syntax tree (promql-parser, the
    Rust parser Prometheus-compatible databases use). A Grafana expression has its variables
    replaced first; `label_values(SELECTOR, label)` (a variable's query) is its selector.
    Raises ValueError when the expression is not PromQL."""
    import promql_parser

    if m := _LABEL_VALUES.match(expr.strip()):
        expr = m.group(1)
    expr = _GRAFANA_VARIABLE.sub(".*", _GRAFANA_RANGES.sub("5m", expr))
    names: set[str] = set()

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.add(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names
