"""Load traces and their replay on a virtual clock: the planner's decisions against a recorded load.

A trace (JSON lines) records the load a pool was offered, tick by tick, as totals over the pool:

    {"interval_s": 5, "pools": {"prefill/m/interactive": {"replicas": 1}}, "cold": {...}}
    {"t": 0, "pools": {"prefill/m/interactive": {"queued_prefill_tokens": 900, "running": 0,
                                                 "waiting": 0, "kv": 0.2}}}

`kv` is the pool's KV use in node-capacities (0.2 = a fifth of one node's pool); the figures
are split evenly over the warm replicas the planner has at that moment, so the replay is closed
loop: a scale-out spreads the same load thinner. A node the planner adds reports the header's
`cold` figures (e.g. a huge queue) for its first `cold_s` seconds; a node it removes leaves at once
(the drain itself is tested on real nodes, tests/planner/test_drain_e2e.py).

Measured latency, as the nodes' load frames carry it: a pool's `ttft_p90_s` / `itl_p90_s` with
`ttft_samples` / `itl_samples` — every warm node reports that P90 and its share of the samples,
over the header's `latency_window_s` (default 30), without histograms (so the pool's figure is
that P90, planner/pools.py). Measured figures are replayed as recorded (open loop: a scale-out
does not lower them), unlike the load figures.

Throughput mode: a row's `rates` — `{"MODEL/TIER": {"rate": r, "isl": i, "osl": o,
"prefix_hit": h}}` — is the request rate routed in the interval before `t`; the replay feeds the
arrivals into the planner's rate meters on the virtual clock and sizes the pools with `sizer`
(planner/throughput.py) as the live loop does.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

from planner.config import PlannerMode
from planner.decide import Decision, Direction, Planner
from planner.forecast import RateMeter, pool_forecasts
from planner.pools import NodeSample, PoolKey, group
from planner.throughput import SimSizer, size_pools


def parse_pool(name: str) -> PoolKey:
    role, model, tier = name.split("/")
    return PoolKey(role, model, tier)


@dataclass
class Trace:
    interval_s: float
    start: dict[PoolKey, int]
    cold: dict[str, float]
    #: how long a new node reports the `cold` figures (None: the planner's cold_start_s)
    cold_s: float | None
    ticks: list[tuple[float, dict[PoolKey, dict[str, float]]]]
    #: throughput mode: per tick, {(model, tier): {"rate", "isl", "osl", "prefix_hit"}}
    rates: list[dict[tuple[str, str], dict[str, float]]] = field(default_factory=list)
    latency_window_s: float = 30.0


def load_trace(path: Path) -> Trace:
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    head, rows = lines[0], lines[1:]
    start = {parse_pool(k): int(v.get("replicas", 1)) for k, v in head["pools"].items()}
    ticks = [(float(r["t"]), {parse_pool(k): v for k, v in r["pools"].items()}) for r in rows]
    rates = [{tuple(k.split("/")): v for k, v in r.get("rates", {}).items()} for r in rows]
    return Trace(
        float(head.get("interval_s", 5)),
        start,
        head.get("cold", {}),
        head.get("cold_s"),
        ticks,
        rates,
        float(head.get("latency_window_s", 30)),
    )


@dataclass
class Replay:
    """Runs `planner` over `trace`; `nodes[pool]` is the (node_id, started_at) the planner has."""

    planner: Planner
    trace: Trace
    #: throughput mode's simulator sizing (None: load mode only)
    sizer: SimSizer | None = None
    nodes: dict[PoolKey, list[tuple[str, float]]] = field(default_factory=dict)
    decisions: list[tuple[float, Decision]] = field(default_factory=list)
    #: (t, pool, replicas) after every tick
    sizes: list[tuple[float, PoolKey, int]] = field(default_factory=list)
    _serial: int = 0
    meters: dict[tuple[str, str], RateMeter] = field(default_factory=dict)
    _owed: dict[tuple[str, str], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for pool, n in self.trace.start.items():
            self.nodes[pool] = [self._new(pool, -1e9) for _ in range(n)]

    def _new(self, pool: PoolKey, t: float) -> tuple[str, float]:
        self._serial += 1
        return f"{pool.role}-{self._serial}", t

    def _samples(self, t: float, pools: dict[PoolKey, dict[str, float]]) -> list[NodeSample]:
        out = []
        cold_s = self.planner.cfg.cold_start_s if self.trace.cold_s is None else self.trace.cold_s
        for pool, figures in pools.items():
            nodes = self.nodes.get(pool, [])
            warm = [n for n in nodes if t - n[1] >= cold_s] or nodes
            for node_id, started in nodes:
                if (node_id, started) in warm:
                    k = len(warm)
                    out.append(
                        NodeSample(
                            node_id,
                            pool,
                            started,
                            waiting=round(figures.get("waiting", 0) / k),
                            running=round(figures.get("running", 0) / k),
                            kv_usage=figures.get("kv", 0) / k,
                            queued_prefill_tokens=round(
                                figures.get("queued_prefill_tokens", 0) / k
                            ),
                            ttft_p90_s=figures.get("ttft_p90_s", 0.0),
                            ttft_samples=round(figures.get("ttft_samples", 0) / k),
                            itl_p90_s=figures.get("itl_p90_s", 0.0),
                            itl_samples=round(figures.get("itl_samples", 0) / k),
                            latency_window_s=self.trace.latency_window_s,
                        )
                    )
                else:
                    c = self.trace.cold
                    out.append(
                        NodeSample(
                            node_id,
                            pool,
                            started,
                            waiting=int(c.get("waiting", 0)),
                            running=int(c.get("running", 0)),
                            kv_usage=c.get("kv", 0.0),
                            queued_prefill_tokens=int(c.get("queued_prefill_tokens", 0)),
                        )
                    )
        return out

    def _route(self, t: float, rates: dict[tuple[str, str], dict[str, float]]) -> None:
        """The interval's arrivals, evenly spaced before `t`, into the rate meters."""
        dt = self.trace.interval_s
        for key, r in rates.items():
            meter = self.meters.setdefault(key, RateMeter(self.planner.cfg.forecast_window_s))
            owed = self._owed.get(key, 0.0) + r["rate"] * dt
            n = int(owed)
            self._owed[key] = owed - n
            isl = round(r.get("isl", 0))
            for i in range(n):
                meter.add(
                    t - dt + (i + 1) * dt / n,
                    isl,
                    round(r.get("osl", 0)),
                    round(isl * r.get("prefix_hit", 0)),
                )

    def run(self) -> Replay:
        cfg = self.planner.cfg
        for i, (t, figures) in enumerate(self.trace.ticks):
            pools = group(self._samples(t, figures), t, cfg.cold_start_s)
            targets = None
            if cfg.mode == PlannerMode.THROUGHPUT and self.sizer is not None:
                self._route(t, self.trace.rates[i] if i < len(self.trace.rates) else {})
                targets = size_pools(
                    self.sizer,
                    list(pools),
                    pool_forecasts(self.meters, pools, t, cfg.cold_start_s),
                    cfg,
                )
            for d in self.planner.step(t, pools, targets=targets):
                self.decisions.append((t, d))
                if d.direction == Direction.OUT:
                    self.nodes[d.pool].append(self._new(d.pool, t))
                elif d.direction == Direction.IN:
                    self.nodes[d.pool] = [n for n in self.nodes[d.pool] if n[0] != d.victim]
            for pool, nodes in self.nodes.items():
                self.sizes.append((t, pool, len(nodes)))
        return self

    def steps(self, pool: PoolKey | None = None) -> list[tuple[float, Decision]]:
        return [
            (t, d)
            for t, d in self.decisions
            if d.direction != Direction.HOLD and (pool is None or d.pool == pool)
        ]

    def direction_changes(self, pool: PoolKey) -> int:
        dirs = [d.direction for _, d in self.steps(pool)]
        return sum(1 for a, b in itertools.pairwise(dirs) if a != b)
