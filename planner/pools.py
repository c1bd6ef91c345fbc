"""What the planner sizes: a pool is role × model × tier (the node's routing pool label), and its
load as one figure per pool, summed over the pool's warm nodes.

Invariants:
- a draining node is in no pool's count: it is already leaving;
- a node in its cold-start period (`now - started_at < cold_start_s`) counts as a replica but
  its figures are left out (so are those of a node that does not report load: a broken event
  stream says nothing about capacity) (Dynamo #12430: a node loading weights and warming its kernels
  shows queues that say nothing about the pool's capacity), and the pool is marked `cold` so
  the planner holds it until the step that added the node has landed;
- a node's measured latency (its load frame's TTFT / ITL P90 over its last `latency_window_s`)
  counts only once that whole window lies past its cold start (`now - started_at ≥ cold_start_s
  + latency_window_s`): the first requests of a warming node are as slow as its queues are long.
- the pool's measured P90 is a pool quantile: the nearest-rank P90 of its counted nodes'
  histograms merged (protocol/latency_hist.py; within 4.9 % of the P90 of the pooled samples).
  Not a mean of the nodes' P90s: one slow node with a fifth of the samples holds the pool's
  whole tail, which such a mean hides (or, the other way, it can report a tail the pool lacks).
  A node whose frame carries no histogram (an older node, a trace) counts as before: its P90
  weighted by its samples, and the pool's figure is the sample-weighted mean of the merged P90
  and those nodes' P90s (all nodes old: exactly the former weighted mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.cluster import NodeStatus
from protocol.latency_hist import LatencyHistogram, MergedLatency


@dataclass(frozen=True, order=True)
class PoolKey:
    role: str  # "prefill" | "decode" | "both"
    model: str
    tier: str  # the node's pool label: "shared" | "interactive" | "batch"

    def labels(self) -> dict[str, str]:
        return {"role": self.role, "model": self.model, "pool": self.tier}

    def __str__(self) -> str:
        return f"{self.role}/{self.model}/{self.tier}"


@dataclass(frozen=True)
class NodeSample:
    """One node's last load frame, as the planner reads it (coordinator NodeView or a trace)."""

    node_id: str
    pool: PoolKey
    started_at: float  # same clock as `now`
    status: NodeStatus = NodeStatus.ACTIVE
    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0  # fraction 0..1
    queued_prefill_tokens: int = 0
    #: the node has reported load at all (a node with no frame yet is cold whatever its age)
    reporting: bool = True
    #: measured over the node's last `latency_window_s` (0 samples: not measured)
    ttft_p90_s: float = 0.0
    ttft_samples: int = 0
    itl_p90_s: float = 0.0
    itl_samples: int = 0
    latency_window_s: float = 0.0
    #: the windows' distributions (None: the frame has none, an older node)
    ttft_hist: LatencyHistogram | None = None
    itl_hist: LatencyHistogram | None = None
    #: the engine's busy fraction over the node's recent window (None: not reported)
    busy: float | None = None


@dataclass
class PoolLatency:
    """One measured latency of a pool: the histograms of the nodes that send one, merged, and
    the P90 × samples of those that do not (older frames)."""

    merged: MergedLatency = field(default_factory=MergedLatency)
    fallback_weighted: float = 0.0
    fallback_samples: int = 0

    def add(self, p90_s: float, samples: int, hist: LatencyHistogram | None) -> None:
        # a histogram of a bucket scheme this planner does not know is as if absent
        if hist is None or not self.merged.add(hist):
            self.fallback_weighted += p90_s * samples
            self.fallback_samples += samples

    @property
    def samples(self) -> int:
        return self.merged.total + self.fallback_samples

    def p90(self) -> float:
        n = self.samples
        if not n:
            return 0.0
        return (self.merged.quantile(0.9) * self.merged.total + self.fallback_weighted) / n


@dataclass
class PoolLoad:
    """A pool's figures: totals over its warm nodes (divide by a replica count to predict)."""

    key: PoolKey
    #: active replicas (warm + cold); draining ones are not counted
    replicas: int = 0
    #: replicas draining out of the pool: not capacity (no routing), but still machines, so
    #: they count against the node budget until they are gone
    draining: int = 0
    #: replicas whose figures count (past their cold start, reporting)
    warm: int = 0
    #: replicas still in their cold start
    starting: int = 0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0  # sum of fractions
    queued_prefill_tokens: float = 0.0
    #: the warm nodes' busy fractions summed — the pool's work in node-seconds per second —
    #: or None when any warm node does not report one (then n − 1 cannot be judged by it)
    busy: float | None = None
    #: the longest window those fractions were taken over (the nodes' `latency_window_s`)
    busy_window_s: float = 0.0
    #: active node ids, warm ones first, least loaded first (the scale-in victim is [0])
    candidates: list[str] = field(default_factory=list)
    #: measured latency over the warm nodes whose window is past their cold start, and the
    #: longest window
    ttft: PoolLatency = field(default_factory=PoolLatency)
    itl: PoolLatency = field(default_factory=PoolLatency)
    latency_window_s: float = 0.0

    @property
    def cold(self) -> bool:
        return self.starting > 0

    def measured(self) -> Measured:
        return Measured(
            ttft_p90_s=self.ttft.p90(),
            ttft_samples=self.ttft.samples,
            ttft_merged_samples=self.ttft.merged.total,
            itl_p90_s=self.itl.p90(),
            itl_samples=self.itl.samples,
            itl_merged_samples=self.itl.merged.total,
            window_s=self.latency_window_s,
        )


@dataclass(frozen=True)
class Measured:
    """A pool's measured TTFT / ITL P90 over its nodes' recent windows, with the sample counts
    and how many of them came in histograms (the rest: older nodes' P90s, weighted)."""

    ttft_p90_s: float = 0.0
    ttft_samples: int = 0
    itl_p90_s: float = 0.0
    itl_samples: int = 0
    window_s: float = 0.0
    ttft_merged_samples: int = 0
    itl_merged_samples: int = 0

    def as_dict(self) -> dict[str, float]:
        return {
            "ttft_p90_s": round(self.ttft_p90_s, 4),
            "ttft_samples": self.ttft_samples,
            "itl_p90_s": round(self.itl_p90_s, 4),
            "itl_samples": self.itl_samples,
            "ttft_merged_samples": self.ttft_merged_samples,
            "itl_merged_samples": self.itl_merged_samples,
        }


def group(samples: list[NodeSample], now: float, cold_start_s: float) -> dict[PoolKey, PoolLoad]:
    """Per pool: its replicas, and the totals of its warm nodes' figures."""
    out: dict[PoolKey, PoolLoad] = {}
    ranked: dict[PoolKey, list[tuple[int, float, float, str]]] = {}
    unbusy: set[PoolKey] = set()  # pools with a warm node that reports no busy fraction
    for s in samples:
        p = out.setdefault(s.pool, PoolLoad(s.pool))
        if s.status == NodeStatus.DRAINING:
            p.draining += 1
            continue
        p.replicas += 1
        young = now - s.started_at < cold_start_s
        p.starting += young
        warm = s.reporting and not young
        work = s.running + s.waiting + s.queued_prefill_tokens / 512
        ranked.setdefault(s.pool, []).append((0 if warm else 1, work, s.kv_usage, s.node_id))
        if not warm:
            continue
        p.warm += 1
        p.waiting += s.waiting
        p.running += s.running
        p.kv_usage += s.kv_usage
        p.queued_prefill_tokens += s.queued_prefill_tokens
        if s.busy is None:
            unbusy.add(s.pool)
        else:  # a node's figure, not trusted to be a fraction
            p.busy = (p.busy or 0.0) + min(1.0, max(0.0, s.busy))
            p.busy_window_s = max(p.busy_window_s, s.latency_window_s)
        if now - s.started_at >= cold_start_s + s.latency_window_s:
            p.ttft.add(s.ttft_p90_s, s.ttft_samples, s.ttft_hist)
            p.itl.add(s.itl_p90_s, s.itl_samples, s.itl_hist)
            p.latency_window_s = max(p.latency_window_s, s.latency_window_s)
    for key, rows in ranked.items():  # a pool of draining nodes only has no candidates
        out[key].candidates = [r[3] for r in sorted(rows)]
    for key in unbusy:
        out[key].busy = None
    return out
