"""The planner in a coordinator replica: every `interval_s`, if this replica leads, read the
nodes it sees (their registrations and last load frames), decide (planner/decide.py) and hand
each step to the actuator — one actuation per pool at a time, in its own task (a drain can take
minutes; other pools keep being planned meanwhile).

While the actuator is not ready (`Actuator.ready()`: the local one until `duet up` is all
up) the leader decides nothing: a step then would fail at once and cool its pool down.

A follower does nothing but keep its rate meters warm (every replica routes, so every replica
measures what it routes); on gaining leadership it starts deciding at the next tick. Losing it
mid-actuation lets the step finish (a half-done drain is worse than a late one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from planner.actuator import ActResult, Actuator, Outcome, Victim
from planner.config import PlannerConfig, PlannerMode
from planner.decide import Decision, Direction, Planner
from planner.forecast import RateMeter, pool_forecasts
from planner.history import DecisionLog
from planner.metrics import PlannerMetrics
from planner.pools import NodeSample, PoolKey, PoolLoad, group
from planner.throughput import size_pools
from protocol.planner import PlannerReport
from protocol.route import RouteRequest

log = logging.getLogger("duet.planner")


def samples(views: Any, now_mono: float, stale_s: float) -> list[NodeSample]:
    """NodeSamples from a coordinator's NodeViews (started_at is the node's unix start time)."""
    out = []
    for v in views:
        info, load = v.info, v.load
        fresh = load is not None and v.connected and now_mono - v.load_at <= stale_s
        out.append(
            NodeSample(
                node_id=info.node_id,
                pool=PoolKey(info.role, info.model, info.pool),
                started_at=info.started_at,
                status=info.status,
                reporting=fresh,
                waiting=load.num_requests_waiting if load else 0,
                running=load.num_requests_running if load else 0,
                kv_usage=load.kv_cache_usage_perc if load else 0.0,
                queued_prefill_tokens=load.queued_prefill_tokens if load else 0,
                ttft_p90_s=load.ttft_p90_s if load else 0.0,
                ttft_samples=load.ttft_samples if load else 0,
                itl_p90_s=load.itl_p90_s if load else 0.0,
                itl_samples=load.itl_samples if load else 0,
                latency_window_s=load.latency_window_s if load else 0.0,
                ttft_hist=load.ttft_hist if load else None,
                itl_hist=load.itl_hist if load else None,
                busy=load.busy if load else None,
            )
        )
    return out


class PlannerLoop:
    def __init__(
        self,
        coordinator: Any,
        cfg: PlannerConfig,
        actuator: Actuator,
        *,
        sizer: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.coordinator = coordinator
        self.cfg = cfg
        self.actuator = actuator
        self.metrics = PlannerMetrics(coordinator.metrics.registry)
        self.planner = Planner(cfg, self.metrics)
        self.sizer = sizer
        self.clock = clock
        self.meters: dict[tuple[str, str], RateMeter] = {}
        self.busy: dict[PoolKey, asyncio.Task[ActResult]] = {}
        #: nodes an actuator started that have not registered yet: pool → [(node count to reach,
        #: give up waiting at)]; they count as cold replicas (budget, no second step meanwhile)
        self.pending: dict[PoolKey, tuple[int, float]] = {}
        self.results: list[tuple[Decision, ActResult]] = []
        #: the recent decisions `GET /planner` serves (planner/history.py)
        self.history = DecisionLog()
        #: why the actuator cannot act yet (its `ready()`); None once it can
        self.waiting: str | None = None
        coordinator.route_observers.append(self.on_route)
        coordinator.planner_report = self.report

    def report(self, limit: int | None = None) -> PlannerReport:
        h = self.history
        return PlannerReport(
            replica_id=self.coordinator.replica_id,
            is_leader=self.coordinator.election.is_leader,
            mode=str(self.cfg.mode),
            actuator=self.actuator.name,
            interval_s=self.cfg.interval_s,
            last_tick=h.last_tick,
            pools=list(h.pools.values()),
            decisions=h.newest(limit),
            waiting=self.waiting,
        )

    def on_route(self, req: RouteRequest, decision: Any) -> None:
        resp = decision.response
        target = resp.prefill or resp.decode
        meter = self.meters.setdefault((req.model, req.tier), RateMeter(self.cfg.forecast_window_s))
        meter.add(
            time.monotonic(),
            req.num_prompt_tokens,
            req.max_tokens,
            target.cached_tokens if target else 0,
        )

    # -- throughput mode -----------------------------------------------------------------------
    async def _targets(self, pools: dict[PoolKey, PoolLoad]) -> dict[PoolKey, int]:
        # the meters are read here, on the loop that feeds them; only the simulation is threaded
        fc = pool_forecasts(self.meters, pools, time.monotonic(), self.cfg.cold_start_s)
        return await asyncio.to_thread(size_pools, self.sizer, list(pools), fc, self.cfg)

    # -- the loop ------------------------------------------------------------------------------
    async def tick(self) -> list[Decision]:
        c = self.coordinator
        if not c.election.is_leader:
            return []
        for key in [k for k, t in self.busy.items() if t.done()]:
            del self.busy[key]
        waiting = await self.actuator.ready()
        if (
            waiting is not None
        ):  # a step now could only fail (and cool the pool down): decide nothing
            if waiting != self.waiting:
                log.info("planner waits for the %s actuator: %s", self.actuator.name, waiting)
            self.waiting = waiting
            return []
        if self.waiting is not None:
            log.info("planner: the %s actuator is ready; deciding", self.actuator.name)
            self.waiting = None
        pools = group(
            samples(c.views.values(), time.monotonic(), c.config.policy.stale_load_s),
            self.clock(),
            self.cfg.cold_start_s,
        )
        self._add_pending(pools)
        targets = None
        if self.cfg.mode == PlannerMode.THROUGHPUT and self.sizer is not None:
            targets = await self._targets(pools)
        decisions = self.planner.step(self.clock(), pools, targets=targets, busy=set(self.busy))
        self.history.tick(self.clock(), decisions)
        for d in decisions:
            if d.direction != Direction.HOLD:
                self.busy[d.pool] = asyncio.create_task(self._act(d), name=f"planner-{d.pool}")
        return decisions

    def _add_pending(self, pools: dict[PoolKey, PoolLoad]) -> None:
        """A started node is invisible until it registers (seconds to minutes: loading weights):
        count it as a cold replica meanwhile, so the pool neither steps again nor overdraws the
        budget. Given up after `pending_timeout_s` (the actuator said done; the platform did
        not)."""
        now = time.monotonic()
        for key, (reach, until) in list(self.pending.items()):
            p = pools.get(key)
            seen = p.replicas if p is not None else 0
            if seen >= reach or now > until:
                if seen < reach:
                    log.warning(
                        "%s: the node started for it has not registered after %.0f s; no longer "
                        "waiting",
                        key,
                        self.cfg.pending_timeout_s,
                    )
                del self.pending[key]
                continue
            if p is None:
                p = pools[key] = PoolLoad(key)
            p.replicas += reach - seen
            p.starting += reach - seen

    async def _act(self, d: Decision) -> ActResult:
        try:
            if d.direction == Direction.OUT:
                r = await self.actuator.scale_out(d.pool, d.desired)
            else:
                view = self.coordinator.views.get(d.victim)
                if view is None:
                    r = ActResult(Outcome.FAILED, f"{d.victim} left before it could be drained")
                else:
                    r = await self.actuator.scale_in(
                        d.pool, Victim(d.victim or "", view.info.url), d.desired
                    )
        except Exception as e:  # an actuator bug must not end the planner
            log.exception("actuator %s failed on %s", self.actuator.name, d.describe())
            r = ActResult(Outcome.FAILED, f"{type(e).__name__}: {e}")
        if d.direction == Direction.OUT and r.outcome == Outcome.DONE:
            self.pending[d.pool] = (d.desired, time.monotonic() + self.cfg.pending_timeout_s)
        self.metrics.actuated(self.actuator.name, d.direction, str(r.outcome))
        (log.info if r.outcome == Outcome.DONE else log.warning)(
            "actuator %s: %s %s → %s: %s",
            self.actuator.name,
            d.direction,
            d.pool,
            r.outcome,
            r.detail,
        )
        self.results.append((d, r))
        self.history.acted(d.pool, r)
        return r

    async def run(self) -> None:
        log.info(
            "planner on (%s mode, %s actuator, every %.0f s, cooldown %.0f s, cold start %.0f s, "
            "budget %s)",
            self.cfg.mode,
            self.actuator.name,
            self.cfg.interval_s,
            self.cfg.cooldown_s,
            self.cfg.cold_start_s,
            self.cfg.node_budget,
        )
        try:
            while True:
                try:
                    await self.tick()
                except Exception:
                    log.exception("planner tick failed; trying again next tick")
                await asyncio.sleep(self.cfg.interval_s)
        finally:
            for t in self.busy.values():
                t.cancel()
            for t in self.busy.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.actuator.close()
