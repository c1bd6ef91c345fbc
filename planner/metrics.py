"""The planner's Prometheus metrics (`duet:planner_*`), on the coordinator's registry.

- `duet:planner_desired_replicas{role,model,pool}` / `duet:planner_current_replicas{...}`: what
  the last tick saw and wanted (desired differs from current while a step is blocked, too);
- `duet:planner_decisions_total{role,model,pool,direction,reason}`: every step (out/in), and
  every tick a wanted step was held (cooldown, budget, at_bound, cold_start, actuating);
- `duet:planner_actuations_total{actuator,direction,outcome}`: what the actuator did with them;
- `duet:planner_predicted_ttft_seconds` / `..._itl_seconds{role,model,pool}`: load mode's
  prediction at the current size (the input of the last decision);
- `duet:planner_measured_ttft_seconds` / `..._itl_seconds{role,model,pool}`: the pool's measured
  P90 from its nodes' load frames (their histograms merged, planner/pools.py), while it has the
  samples to count (the series is removed when it has not: a stale figure must not read as a current
  one).
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge

from planner.decide import Decision, Direction, Reason

_LABELS = ("role", "model", "pool")
#: holds worth counting: a step was wanted (or the planner could not look) and did not happen
_COUNTED_HOLDS = {
    Reason.COOLDOWN,
    Reason.BUDGET,
    Reason.AT_BOUND,
    Reason.COLD_START,
    Reason.ACTUATING,
}


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry if registry is not None else CollectorRegistry()
        self.registry = r
        self.desired = Gauge(
            "duet:planner_desired_replicas",
            "replicas the planner wants per pool",
            _LABELS,
            registry=r,
        )
        self.current = Gauge(
            "duet:planner_current_replicas",
            "active replicas per pool as the planner saw them",
            _LABELS,
            registry=r,
        )
        self.decisions = Counter(
            "duet:planner_decisions",
            "planner steps and blocked steps by direction and reason",
            (*_LABELS, "direction", "reason"),
            registry=r,
        )
        self.actuations = Counter(
            "duet:planner_actuations",
            "actuator results by direction and outcome",
            ("actuator", "direction", "outcome"),
            registry=r,
        )
        self.ttft = Gauge(
            "duet:planner_predicted_ttft_seconds",
            "load mode's TTFT prediction at the current size",
            _LABELS,
            registry=r,
        )
        self.itl = Gauge(
            "duet:planner_predicted_itl_seconds",
            "load mode's ITL prediction at the current size",
            _LABELS,
            registry=r,
        )
        self.measured = {
            "ttft": Gauge(
                "duet:planner_measured_ttft_seconds",
                "the pool's measured TTFT P90 load mode counts",
                _LABELS,
                registry=r,
            ),
            "itl": Gauge(
                "duet:planner_measured_itl_seconds",
                "the pool's measured ITL P90 load mode counts",
                _LABELS,
                registry=r,
            ),
        }

    def record(self, d: Decision) -> None:
        labels = d.pool.labels()
        self.desired.labels(**labels).set(d.desired)
        self.current.labels(**labels).set(d.current)
        if d.direction != Direction.HOLD or d.reason in _COUNTED_HOLDS:
            self.decisions.labels(**labels, direction=str(d.direction), reason=str(d.reason)).inc()
        at_n = d.inputs.get("at_n")
        if isinstance(at_n, dict):
            self.ttft.labels(**labels).set(at_n["ttft_s"])
            self.itl.labels(**labels).set(at_n["itl_s"])
        m = d.inputs.get("measured")
        use = m.get("counted", []) if isinstance(m, dict) else []
        for figure, gauge in self.measured.items():
            if figure in use:
                gauge.labels(**labels).set(m[f"{figure}_p90_s"])  # type: ignore[index]
            else:
                with contextlib.suppress(KeyError):
                    gauge.remove(*labels.values())

    def actuated(self, actuator: str, direction: Direction, outcome: str) -> None:
        self.actuations.labels(actuator=actuator, direction=str(direction), outcome=outcome).inc()
