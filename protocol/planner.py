"""`GET /planner` on a coordinator replica: the autoscaler's recent decisions (planner/loop.py)
as the console's Cluster page and operators read them.

Served behind the internal plane's cluster secret like `/cluster`; 404 `planner_off` on a
replica started without `--planner`. Only the leader decides, so a follower's report holds the
decisions it made while it led (if ever) and `is_leader: false`.

Invariants: `decisions` is bounded (the newest `DecisionLog.maxlen`, newest first) and holds
every step (out / in) and the first tick of each run of blocked holds per pool (cooldown,
budget, at_bound, cold_start, actuating), never one entry per tick; `seq` grows by one per
entry over the replica's life. `direction`, `reason` and `outcome` are the values of
planner.decide.Direction / Reason and planner.actuator.Outcome, kept as strings on the wire so
a reader never fails on a reason a newer planner added.
"""

from __future__ import annotations

import msgspec


class Prediction(msgspec.Struct, frozen=True, kw_only=True):
    """Load mode's per-node prediction at `n` replicas (planner/predict.py::Prediction)."""

    n: int
    ttft_s: float
    itl_s: float
    kv: float
    waiting: float
    #: each node's busy fraction at n (prefill pools' scale-in test; None: not reported)
    busy: float | None = None


class PoolFigures(msgspec.Struct, frozen=True, kw_only=True):
    """A pool's warm-load totals, averaged over the decision window."""

    waiting: float
    running: float
    kv_sum: float
    queued_prefill_tokens: float
    #: the warm nodes' busy fractions summed (None: not every node reports one)
    busy_sum: float | None = None


class MeasuredLatency(msgspec.Struct, frozen=True, kw_only=True):
    """The pool's measured TTFT / ITL P90 from its nodes' load frames (planner/pools.py::Measured)
    and which of them counted (enough samples, window after the pool's last step).

    A P90 is the pool's quantile: the P90 of the nodes' latency histograms merged (within 4.9 %
    of the pooled samples' own, protocol/latency_hist.py). `*_merged_samples` of the samples
    came in histograms; the rest are older nodes' own P90s, weighted by their samples (all of
    them: the P90 is the sample-weighted mean of the nodes' P90s, as before histograms)."""

    ttft_p90_s: float = 0.0
    ttft_samples: int = 0
    itl_p90_s: float = 0.0
    itl_samples: int = 0
    ttft_merged_samples: int = 0
    itl_merged_samples: int = 0
    #: "ttft" / "itl": the figures taken as max(predicted, measured)
    counted: list[str] = []


class SLOBounds(msgspec.Struct, frozen=True, kw_only=True):
    ttft_s: float
    itl_s: float


class Budget(msgspec.Struct, frozen=True, kw_only=True):
    total: int
    limit: int


class DecisionInputs(msgspec.Struct, frozen=True, kw_only=True):
    """The figures a decision used (planner/decide.py `Decision.inputs`): what is absent was not
    looked at (a pool held for its cold start has no prediction)."""

    replicas: int = 0
    warm: int = 0
    #: the pool's [min, max] replicas
    bounds: tuple[int, int] | None = None
    #: throughput mode: the simulator's size for the forecast rate
    target: int | None = None
    load: PoolFigures | None = None
    at_n: Prediction | None = None
    at_n_minus_1: Prediction | None = None
    #: load mode: what the nodes measured (absent: no samples)
    measured: MeasuredLatency | None = None
    slo: SLOBounds | None = None
    #: the step a hold kept from happening ("out" / "in")
    blocked: str | None = None
    budget: Budget | None = None


class PlannerDecision(msgspec.Struct, frozen=True, kw_only=True):
    seq: int
    #: unix time of the tick
    at: float
    role: str
    model: str
    #: the nodes' routing pool label (shared / interactive / batch)
    tier: str
    direction: str
    reason: str
    current: int
    desired: int
    #: scale-in: the node drained and stopped
    victim: str | None = None
    inputs: DecisionInputs = DecisionInputs()
    #: the actuator's answer to a step (None: a hold, or the step still in flight)
    outcome: str | None = None
    detail: str = ""


class PoolState(msgspec.Struct, frozen=True, kw_only=True):
    """A pool as the last tick saw it."""

    role: str
    model: str
    tier: str
    current: int
    desired: int
    direction: str
    reason: str


class PlannerReport(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    is_leader: bool
    #: "load" | "throughput"
    mode: str
    #: "local" | "kubernetes" | "virtual"
    actuator: str
    interval_s: float
    #: unix time of the last tick this replica decided at (None: never led)
    last_tick: float | None
    pools: list[PoolState]
    #: newest first
    decisions: list[PlannerDecision]
    #: why the leader decides nothing yet: its actuator cannot act (the local one while `duet up`
    #: still starts); None once it can
    waiting: str | None = None
