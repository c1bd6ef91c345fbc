"""One simulation end to end: a profile, a layout, a workload → a Summary (and the collector,
for timelines). Runs on a fresh virtual-time loop, so it can be called from plain code."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from sim import vclock
from sim.cluster import Layout, SimCluster
from sim.early import EarlyStop
from sim.profile import Profile
from sim.stats import SLO, Collector, Summary, summarize
from sim.workload import WorkItem


def simulate(
    profile: Profile,
    layout: Layout,
    items: Iterable[WorkItem],
    *,
    slo: SLO | None = None,
    warmup_s: float = 0.0,
    node_price_per_hour: float | None = None,
    progress: Callable[[float], None] | None = None,
    stop_early: bool = False,
    step_jitter: float = 0.0,
    seed: int = 0,
) -> tuple[Summary, Collector]:
    """`stop_early` (with an `slo`): end the run as soon as the SLO is certainly missed
    (sim/early.py) — the summary then says so in `violations`, and its figures cover only what
    ran; for searches that need only pass/fail from a failing run. `step_jitter`, `seed`: seeded
    noise on every step's time (sim/jitter.py), for sensitivity runs; 0 (default): none."""
    cluster = SimCluster(profile, layout, step_jitter=step_jitter, seed=seed)
    if stop_early and slo is not None:
        items = list(items)
        cluster.early = EarlyStop(slo, sum(1 for x in items if x.t >= warmup_s), warmup_s)
    collector = vclock.run(cluster.run(items, progress=progress))
    assert isinstance(collector, Collector)
    return summarize(
        collector, slo=slo, warmup_s=warmup_s, node_price_per_hour=node_price_per_hour
    ), collector
