"""One simulation end to end: a profile, a layout, a workload → a Summary (and the collector,
for timelines). Runs on a fresh virtual-time loop, so it can be called from plain code."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sim import vclock
from sim.cluster import Layout, SimCluster
from sim.profile import Profile
from sim.stats import SLO, Collector, Summary, summarize
from sim.workload import WorkItem


def simulate(profile: Profile, layout: Layout, items: Iterable[WorkItem], *, slo: SLO | None = None,
             warmup_s: float = 0.0, node_price_per_hour: float | None = None,
             progress: Callable[[float], None] | None = None) -> tuple[Summary, Collector]:  # fmt: skip
    cluster = SimCluster(profile, layout)
    collector = vclock.run(cluster.run(items, progress=progress))
    assert isinstance(collector, Collector)
    return summarize(collector, slo=slo, warmup_s=warmup_s, node_price_per_hour=node_price_per_hour), collector
