"""The planner's decisions: per pool, one step out, one step in, or hold — and why.

Pure code on an injected clock (`now` arguments): the live loop (planner/loop.py) and the trace
replays (planner/trace.py, tests) run exactly this.

Rules, in order, per pool:
1. below its min → out; above its max → in (bounds win over everything but the budget and
   the plain cool-down);
2. an actuation still in flight, a node still in its cold start, or too few samples → hold;
3. load mode: out when the pool, its load spread over its warm replicas, is predicted to miss
   its tier's SLO (TTFT for P, ITL / KV / admission queue for D); in when at N−1 every figure
   stays under (1 − margin) × its bound (the survivors carry the leaver's load). TTFT and ITL
   are max(predicted, measured) where the nodes' measured P90 has `min_latency_samples` and its
   window began after the pool's last step (reasons `ttft_measured` / `itl_measured` when the
   measurement is what crossed the bound);
   throughput mode: towards the simulator's size for the forecast rate (planner/throughput.py);
4. pacing: one step at a time; `cooldown_s` after any step on the pool, `reverse_cooldown_s`
   before a step the other way (hysteresis + these two keep a noisy load from flapping);
5. budget: every out counts against `node_budget` (all pools and models); outs are granted
   interactive first, then shared, then batch, most-violating first. An in never waits for it.

Invariants: at most one step per pool per tick; `desired` is always within the pool's bounds;
the figures a decision used are in `Decision.inputs` (logged and kept for the trace tests).
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from dataclasses import dataclass, field

from planner.config import PlannerConfig, PlannerMode
from planner.pools import Measured, PoolKey, PoolLoad
from planner.predict import counted, predict, too_busy, violations, with_measured

log = logging.getLogger("duet.planner")


class Direction(enum.StrEnum):
    OUT = "out"
    IN = "in"
    HOLD = "hold"


class Reason(enum.StrEnum):
    TTFT = "ttft"
    ITL = "itl"
    #: the nodes' measured P90 (above the prediction) misses the SLO
    TTFT_MEASURED = "ttft_measured"
    ITL_MEASURED = "itl_measured"
    KV_CACHE = "kv_cache"
    QUEUE = "queue"
    #: scale-in: the pool at N−1 still meets its SLO with margin
    HEADROOM = "headroom"
    FORECAST = "forecast"
    BELOW_MIN = "below_min"
    ABOVE_MAX = "above_max"
    # holds that kept a pool from a step it wanted, or from deciding at all:
    COOLDOWN = "cooldown"
    COLD_START = "cold_start"
    BUDGET = "budget"
    AT_BOUND = "at_bound"
    ACTUATING = "actuating"
    NO_DATA = "no_data"
    STEADY = "steady"


_PRIORITY = {"interactive": 0, "shared": 1, "batch": 2}
_NO_MEASUREMENT = Measured()


@dataclass(frozen=True)
class Decision:
    pool: PoolKey
    current: int
    desired: int
    direction: Direction
    reason: Reason
    #: scale-in: the node to drain and stop (least loaded warm node)
    victim: str | None = None
    inputs: dict[str, object] = field(default_factory=dict)

    def describe(self) -> str:
        return (
            f"planner {self.direction} {self.pool}: {self.current} → {self.desired} ({self.reason})"
            f"{f' draining {self.victim}' if self.victim else ''}; inputs {self.inputs}"
        )


@dataclass
class _Window:
    """A pool's warm-load samples since its last step: (t, waiting, running, kv, queued tokens,
    busy sum or None)."""

    samples: deque[tuple[float, float, float, float, float, float | None]] = field(
        default_factory=deque
    )
    last_step_at: float | None = None
    last_direction: Direction | None = None
    last_hold: Reason | None = None

    def add(self, now: float, p: PoolLoad, window_s: float) -> None:
        self.samples.append(
            (now, p.waiting, p.running, p.kv_usage, p.queued_prefill_tokens, p.busy)
        )
        while self.samples and now - self.samples[0][0] > window_s:
            self.samples.popleft()

    def mean(self, p: PoolLoad) -> PoolLoad:
        n = len(self.samples)
        busy = [s[5] for s in self.samples if s[5] is not None]
        return PoolLoad(
            p.key,
            replicas=p.replicas,
            warm=p.warm,
            waiting=sum(s[1] for s in self.samples) / n,
            running=sum(s[2] for s in self.samples) / n,
            kv_usage=sum(s[3] for s in self.samples) / n,
            queued_prefill_tokens=sum(s[4] for s in self.samples) / n,
            candidates=p.candidates,
            busy=sum(busy) / n if len(busy) == n else None,
            busy_window_s=p.busy_window_s,
        )

    def span(self) -> float:
        return self.samples[-1][0] - self.samples[0][0] if self.samples else 0.0

    def since_step(self, now: float, window_s: float) -> bool:
        """A node window of `window_s` ending now began after the pool's last step (it measured
        the present size)."""
        return self.last_step_at is None or now - self.last_step_at >= window_s


class Planner:
    def __init__(self, cfg: PlannerConfig, metrics: object | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics  # planner.metrics.PlannerMetrics (duck-typed: `record(decision)`)
        self.windows: dict[PoolKey, _Window] = {}

    def _wanted(
        self,
        p: PoolLoad,
        w: _Window,
        now: float,
        targets: dict[PoolKey, int] | None,
        busy: set[PoolKey],
    ) -> tuple[Direction, Reason, dict[str, object]]:
        cfg = self.cfg
        lo, hi = cfg.bounds_of(p.key)
        inputs: dict[str, object] = {"replicas": p.replicas, "warm": p.warm, "bounds": [lo, hi]}
        if p.key in busy:
            return Direction.HOLD, Reason.ACTUATING, inputs
        if p.replicas < lo:
            return Direction.OUT, Reason.BELOW_MIN, inputs
        if p.replicas > hi:
            return Direction.IN, Reason.ABOVE_MAX, inputs
        if p.cold:
            return Direction.HOLD, Reason.COLD_START, inputs
        if cfg.mode == PlannerMode.THROUGHPUT:
            if targets is None or p.key not in targets:
                return Direction.HOLD, Reason.NO_DATA, inputs
            inputs["target"] = targets[p.key]
            if targets[p.key] > p.replicas:
                return Direction.OUT, Reason.FORECAST, inputs
            if targets[p.key] < p.replicas:
                return Direction.IN, Reason.FORECAST, inputs
            return Direction.HOLD, Reason.STEADY, inputs
        # load mode: decide on the window's mean once it spans half the window
        if not w.samples or w.span() < cfg.window_s / 2:
            return Direction.HOLD, Reason.NO_DATA, inputs
        avg = w.mean(p)
        slo = cfg.slo_of(p.key)
        now_n = predict(avg, p.warm, cfg)
        load: dict[str, float] = {
            "waiting": round(avg.waiting, 2),
            "running": round(avg.running, 2),
            "kv_sum": round(avg.kv_usage, 3),
            "queued_prefill_tokens": round(avg.queued_prefill_tokens),
        }
        if avg.busy is not None:
            load["busy_sum"] = round(avg.busy, 3)
        inputs.update(
            load=load, at_n=now_n.as_dict(), slo={"ttft_s": slo.ttft_s, "itl_s": slo.itl_s}
        )
        m = p.measured()
        # a window that began before the pool's last step measured the old size: not counted
        use = (
            counted(m, p.key.role, cfg.min_latency_samples) if w.since_step(now, m.window_s) else []
        )
        if m.ttft_samples or m.itl_samples:
            inputs["measured"] = {**m.as_dict(), "counted": use}
        floor = m if use else _NO_MEASUREMENT
        effective, raised = with_measured(now_n, floor, p.key.role, cfg.min_latency_samples)
        missed = violations(effective, p.key.role, slo, cfg)
        if missed:
            return (
                Direction.OUT,
                Reason(f"{missed[0]}_measured" if missed[0] in raised else missed[0]),
                inputs,
            )
        if p.warm > 1:
            less = predict(avg, p.warm - 1, cfg)
            inputs["at_n_minus_1"] = less.as_dict()
            less, _ = with_measured(less, floor, p.key.role, cfg.min_latency_samples)
            # the survivors' busy fraction, from windows that saw the pool at its present size
            if not violations(less, p.key.role, slo, cfg, scale=1 - cfg.margin) and not too_busy(
                less, p.key.role, cfg, w.since_step(now, avg.busy_window_s)
            ):
                return Direction.IN, Reason.HEADROOM, inputs
        return Direction.HOLD, Reason.STEADY, inputs

    def step(
        self,
        now: float,
        pools: dict[PoolKey, PoolLoad],
        *,
        targets: dict[PoolKey, int] | None = None,
        busy: set[PoolKey] | frozenset[PoolKey] = frozenset(),
    ) -> list[Decision]:
        """One tick: record the pools' figures, decide per pool, apply pacing and the budget.
        `targets` (throughput mode): the size per pool the forecast asks for. `busy`: pools with
        an actuation in flight."""
        cfg = self.cfg
        for key in list(self.windows):
            if key not in pools:
                del self.windows[key]
        wanted: list[tuple[PoolLoad, Direction, Reason, dict[str, object]]] = []
        for key, p in sorted(pools.items()):
            w = self.windows.setdefault(key, _Window())
            if not p.cold and p.warm and key not in busy:
                w.add(now, p, cfg.window_s)
            direction, reason, inputs = self._wanted(p, w, now, targets, set(busy))
            forced = reason in (Reason.BELOW_MIN, Reason.ABOVE_MAX)
            lo, hi = cfg.bounds_of(key)
            if direction == Direction.OUT and p.replicas >= hi and not forced:
                direction, reason = Direction.HOLD, Reason.AT_BOUND
            if direction == Direction.IN and (p.replicas <= lo or p.warm < 1) and not forced:
                direction, reason = Direction.HOLD, Reason.AT_BOUND
            if direction != Direction.HOLD and w.last_step_at is not None:
                since = now - w.last_step_at
                # bounds skip the reverse cool-down (a pool over its max goes down at once), not
                # the plain one: a step that failed is retried at that pace, not every tick
                reverse = (
                    not forced and direction != w.last_direction and since < cfg.reverse_cooldown_s
                )
                if since < cfg.cooldown_s or reverse:
                    inputs["blocked"] = str(direction)
                    direction, reason = Direction.HOLD, Reason.COOLDOWN
            wanted.append((p, direction, reason, inputs))
        # the budget: outs by priority (interactive first), then the rest of the pool figures.
        # Draining nodes still hold their machines: a pool that just stepped in must not let
        # another step out onto the victim's machine before it is stopped.
        total = sum(p.replicas + p.draining for p in pools.values())
        order = sorted(
            range(len(wanted)),
            key=lambda i: (
                wanted[i][1] != Direction.OUT,
                _PRIORITY.get(wanted[i][0].key.tier, 1),
                wanted[i][2] not in (Reason.BELOW_MIN,),
            ),
        )
        decisions: dict[int, Decision] = {}
        for i in order:
            p, direction, reason, inputs = wanted[i]
            if direction == Direction.OUT and cfg.node_budget is not None:
                inputs["budget"] = {"total": total, "limit": cfg.node_budget}
                if total + 1 > cfg.node_budget:
                    inputs["blocked"] = "out"
                    direction, reason = Direction.HOLD, Reason.BUDGET
                else:
                    total += 1
            decisions[i] = self._decide(now, p, direction, reason, inputs)
        return [decisions[i] for i in range(len(wanted))]

    def _decide(
        self,
        now: float,
        p: PoolLoad,
        direction: Direction,
        reason: Reason,
        inputs: dict[str, object],
    ) -> Decision:
        w = self.windows[p.key]
        desired = p.replicas + (
            1 if direction == Direction.OUT else -1 if direction == Direction.IN else 0
        )
        if direction == Direction.HOLD and inputs.get("blocked"):
            desired = p.replicas + (1 if inputs["blocked"] == "out" else -1)
        victim = p.candidates[0] if direction == Direction.IN and p.candidates else None
        d = Decision(p.key, p.replicas, desired, direction, reason, victim, inputs)
        if direction != Direction.HOLD:
            w.last_step_at, w.last_direction = now, direction
            w.samples.clear()  # the step changes what the figures mean
            log.info("%s", d.describe())
        elif (
            reason == Reason.BUDGET and w.last_hold != Reason.BUDGET
        ):  # once per run of budget holds
            log.info("%s", d.describe())
        w.last_hold = reason if direction == Direction.HOLD else None
        if self.metrics is not None:
            self.metrics.record(d)  # type: ignore[attr-defined]
        return d
