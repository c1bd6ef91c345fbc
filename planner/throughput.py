"""Throughput mode's sizer: how many prefill and decode nodes (or colocated ones) a forecast rate
needs, found on the simulator (sim/: the real scheduler, block pool, router and admission
on the node kind's measured step model) — the same machinery as `duet plan`.

Search: from the pools' minima, simulate the forecast (rate × headroom, its ISL/OSL and prefix
share) on the layout; while it misses the tier's SLO, simulate one more node of each role that
may still grow and keep the better of the two (meets the SLO, else the smaller worst ratio of
TTFT P90 / ITL P99 / failed share to their bounds), within the pools' maxima. Colocated pools grow
alone. The answer is cached per rounded forecast (rates to 2 significant figures), so a steady load
costs no simulation.

Runs in a worker thread (planner/loop.py): a probe is tens of milliseconds to a second of CPU.
"""

from __future__ import annotations

import logging
import math
from functools import lru_cache

from planner.config import PlannerConfig, TierSLO
from planner.forecast import Forecast
from planner.pools import PoolKey
from protocol.cluster import Role

log = logging.getLogger("duet.planner")


def _round(x: float, digits: int = 2) -> float:
    if x <= 0:
        return 0.0
    return round(x, -math.floor(math.log10(abs(x))) + digits - 1)


class SimSizer:
    """Sizes P and D for one node kind (a profile JSON written by `duet bench profile`)."""

    def __init__(self, profile_path: str, headroom: float = 1.2, sim_requests: int = 200) -> None:
        from protocol.profile import load

        self.profile = load(profile_path)
        self.headroom = headroom
        self.sim_requests = sim_requests
        self.simulations = 0
        self._size = lru_cache(maxsize=256)(self._search)

    def size(
        self,
        f: Forecast,
        slo: TierSLO,
        tier: str,
        colocated: bool,
        bounds: dict[str, tuple[int, int]],
    ) -> dict[str, int]:
        """{"prefill": p, "decode": d} (or {"both": n}) for forecast `f`."""
        key = (_round(f.rate * self.headroom), _round(f.isl), _round(f.osl), round(f.prefix_hit, 1))
        return dict(
            self._size(key, slo.ttft_s, slo.itl_s, tier, colocated, tuple(sorted(bounds.items())))
        )

    def _probe(
        self,
        counts: dict[Role, int],
        rate: float,
        isl: float,
        osl: float,
        hit: float,
        slo: TierSLO,
        tier: str,
    ) -> tuple[bool, float, list[str]]:
        """(meets the SLO, worst ratio of a latency figure to its bound, violations)."""
        from sim.cluster import Layout, NodeGroup
        from sim.run import simulate
        from sim.stats import SLO
        from sim.workload import Synthetic, synthetic

        self.simulations += 1
        duration = max(20.0, self.sim_requests / max(rate, 1e-3))
        prefix = round(isl * hit)
        w = Synthetic(
            rate=rate,
            duration_s=duration,
            input_len=str(max(1, round(isl) - prefix)),
            output_len=str(max(1, round(osl))),
            prefix_groups=1 if prefix else 0,
            prefix_len=prefix,
            tier_mix=(("batch" if tier == "batch" else "interactive", 1.0),),
        )
        layout = Layout(tuple(NodeGroup(role, n) for role, n in counts.items() if n > 0))
        s, _ = simulate(
            self.profile,
            layout,
            synthetic(w),
            slo=SLO(ttft_p90_ms=slo.ttft_s * 1e3, itl_p99_ms=slo.itl_s * 1e3),
            warmup_s=duration * 0.2,
        )
        lat = s.latency_ms
        worst = max(
            (lat.get("p90_ttft") or math.inf) / (slo.ttft_s * 1e3),
            (lat.get("p99_itl") or 0.0) / (slo.itl_s * 1e3),
            100 * sum(s.failures.values()) / max(s.requests, 1),
        )  # 1 % failed: at the bound
        return bool(s.meets_slo), worst, s.violations

    def _search(
        self,
        key: tuple[float, float, float, float],
        ttft_s: float,
        itl_s: float,
        tier: str,
        colocated: bool,
        bounds: tuple[tuple[str, tuple[int, int]], ...],
    ) -> tuple[tuple[str, int], ...]:
        rate, isl, osl, hit = key
        b = dict(bounds)
        roles: tuple[Role, ...] = ("both",) if colocated else ("prefill", "decode")
        counts = {r: max(1, b.get(r, (1, 1))[0]) for r in roles}
        if rate <= 0:
            return tuple(counts.items())
        slo = TierSLO(ttft_s=ttft_s, itl_s=itl_s)
        ok, _, why = self._probe(counts, rate, isl, osl, hit, slo, tier)
        while not ok:
            growable = [r for r in roles if counts[r] < b.get(r, (1, 1))[1]]
            if not growable:
                log.info(
                    "throughput sizing: %s at %.2f req/s misses the SLO even at the pools' maxima "
                    "%s (%s)",
                    tier,
                    rate,
                    counts,
                    "; ".join(why),
                )
                break
            best: tuple[bool, float, list[str], dict[Role, int]] | None = None
            for r in growable:
                trial = {**counts, r: counts[r] + 1}
                t_ok, worst, t_why = self._probe(trial, rate, isl, osl, hit, slo, tier)
                if best is None or (t_ok, -worst) > (best[0], -best[1]):
                    best = (t_ok, worst, t_why, trial)
            assert best is not None
            ok, _, why, counts = best
        return tuple(counts.items())


def size_pools(
    sizer: SimSizer,
    pools: list[PoolKey],
    forecasts: dict[tuple[str, str], Forecast],
    cfg: PlannerConfig,
) -> dict[PoolKey, int]:
    """Throughput mode's target size per pool (planner/decide.py `targets`): each model × tier
    with a forecast sized together (P and D, or colocated), within the pools' bounds. Blocking
    (the simulator): the live loop runs it in a worker thread."""
    out: dict[PoolKey, int] = {}
    by_group: dict[tuple[str, str], list[PoolKey]] = {}
    for key in pools:
        by_group.setdefault((key.model, key.tier), []).append(key)
    for group_key, keys in by_group.items():
        f = forecasts.get(group_key)
        if f is None:
            continue
        colocated = all(k.role == "both" for k in keys)
        bounds = {k.role: cfg.bounds_of(k) for k in keys}
        sizes = sizer.size(f, cfg.slo_of(keys[0]), group_key[1], colocated, bounds)
        log.debug("throughput forecast %s/%s %s → %s", *group_key, f.as_dict(), sizes)
        for k in keys:
            if k.role in sizes:
                out[k] = sizes[k.role]
    return out
