"""Load mode with the nodes' measured latency: the planner takes max(predicted,
measured) for TTFT (prefill, colocated) and ITL (decode, colocated) once the measured window has
`min_latency_samples`, names the measured figure in the reason, logs it with the decision, and
leaves a node's cold start and a window older than the pool's last step out.

A table of pools, each decided by the real Planner on a virtual clock; the node window itself
(node/latency_window.py) is tested on its own clock at the end. The pool's P90 is the quantile of
the nodes' histograms merged (protocol/latency_hist.py), not a mean of their P90s: nodes whose
windows differ, the stated 4.9 % resolution on random pools, and an older node's frame (no
histogram) weighed in as before."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest
from prometheus_client import generate_latest

from gateway.console.autoscaler import describe_inputs
from node.latency_window import RecentLatency, Window
from planner.config import PlannerConfig, TierSLO
from planner.decide import Decision, Direction, Planner, Reason
from planner.history import inputs_of
from planner.metrics import PlannerMetrics
from planner.pools import NodeSample, group
from planner.trace import parse_pool
from protocol.latency_hist import RELATIVE_ERROR, LatencyHistogram, nearest_rank

P = parse_pool("prefill/m/interactive")
D = parse_pool("decode/m/interactive")
C = parse_pool("both/m/interactive")
OLD = -1e9  # started long before the trace: warm, its window long past its cold start


def cfg(**kw: object) -> PlannerConfig:
    base = dict(
        interval_s=5,
        window_s=20,
        cooldown_s=30,
        reverse_cooldown_s=90,
        cold_start_s=60,
        default_max=4,
        slo={"interactive": TierSLO(ttft_s=1.0, itl_s=0.15)},
    )
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def node(i: int, pool=P, started: float = OLD, **figures: float) -> NodeSample:
    return NodeSample(f"{pool.role}-{i}", pool, started, latency_window_s=30.0, **figures)  # type: ignore[arg-type]


def decide(nodes: list[NodeSample], planner: Planner | None = None, t0: float = 0.0) -> Decision:
    """The first decision past the window's warm-up (span ≥ window / 2) for the nodes' pool."""
    planner = planner or Planner(cfg())
    pool = nodes[0].pool
    for k in range(10):
        t = t0 + 5 * k
        d = next(
            d for d in planner.step(t, group(nodes, t, planner.cfg.cold_start_s)) if d.pool == pool
        )
        if d.reason != Reason.NO_DATA:
            return d
    raise AssertionError("no decision")


@dataclass
class Row:
    name: str
    nodes: list[NodeSample]
    direction: Direction
    reason: Reason
    counted: list[str] | None  # None: no measured figures in the inputs


# a light prefill load: 200 queued tokens → predicted TTFT 0.12 s, far under the 1 s SLO
LIGHT = {"queued_prefill_tokens": 200, "kv_usage": 0.1}
ROWS = [
    Row(
        "predicted under, measured P90 over: out on the measurement",
        [node(0, ttft_p90_s=1.8, ttft_samples=40, **LIGHT)],
        Direction.OUT,
        Reason.TTFT_MEASURED,
        ["ttft"],
    ),
    Row(
        "the same with 19 samples: too few, ignored",
        [node(0, ttft_p90_s=1.8, ttft_samples=19, **LIGHT)],
        Direction.HOLD,
        Reason.STEADY,
        [],
    ),
    Row(
        "samples summed over the pool's nodes: 2 × 12 count",
        [
            node(0, ttft_p90_s=1.8, ttft_samples=12, **LIGHT),
            node(1, ttft_p90_s=1.6, ttft_samples=12, **LIGHT),
        ],
        Direction.OUT,
        Reason.TTFT_MEASURED,
        ["ttft"],
    ),
    Row(
        "measured under the SLO: nothing to do",
        [node(0, ttft_p90_s=0.4, ttft_samples=40, **LIGHT)],
        Direction.HOLD,
        Reason.STEADY,
        ["ttft"],
    ),
    Row(
        "predicted over and above the measurement: the prediction's reason",
        [node(0, queued_prefill_tokens=6000, ttft_p90_s=1.2, ttft_samples=40)],
        Direction.OUT,
        Reason.TTFT,
        ["ttft"],
    ),
    Row(
        "a decode pool: its measured ITL P90 over the SLO",
        [node(0, D, running=10, kv_usage=0.2, itl_p90_s=0.3, itl_samples=500)],
        Direction.OUT,
        Reason.ITL_MEASURED,
        ["itl"],
    ),
    Row(
        "a decode pool: a TTFT it does not own is not its figure",
        [node(0, D, running=10, kv_usage=0.2, ttft_p90_s=5.0, ttft_samples=500)],
        Direction.HOLD,
        Reason.STEADY,
        [],
    ),
    Row(
        "a colocated pool: either figure",
        [
            node(
                0,
                C,
                running=10,
                kv_usage=0.2,
                ttft_p90_s=0.2,
                ttft_samples=40,
                itl_p90_s=0.2,
                itl_samples=200,
            )
        ],
        Direction.OUT,
        Reason.ITL_MEASURED,
        ["ttft", "itl"],
    ),
    Row(
        "a node past its cold start whose window still holds cold-start requests: not counted",
        [node(0, started=-70.0, ttft_p90_s=5.0, ttft_samples=40, **LIGHT)],
        Direction.HOLD,
        Reason.STEADY,
        None,
    ),
    Row(
        "three nodes, N−1 predicted with margin, but the measured P90 at N is over 0.7 × SLO: held",
        [node(i, queued_prefill_tokens=200, ttft_p90_s=0.8, ttft_samples=40) for i in range(3)],
        Direction.HOLD,
        Reason.STEADY,
        ["ttft"],
    ),
    Row(
        "the same with the measured P90 under the margin: in",
        [node(i, queued_prefill_tokens=200, ttft_p90_s=0.3, ttft_samples=40) for i in range(3)],
        Direction.IN,
        Reason.HEADROOM,
        ["ttft"],
    ),
]


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_decision_with_measured_latency(row: Row) -> None:
    d = decide(row.nodes)
    assert (d.direction, d.reason) == (row.direction, row.reason), d.describe()
    measured = d.inputs.get("measured")
    if row.counted is None:
        assert measured is None
    else:
        assert measured is not None and measured["counted"] == row.counted, d.inputs  # type: ignore[index]
    # the prediction is logged beside the measurement, never replaced by it
    assert d.inputs["at_n"]["ttft_s"] < 1.0 or row.reason == Reason.TTFT  # type: ignore[index]


def test_the_decision_logs_and_exports_the_measured_figure() -> None:
    metrics = PlannerMetrics()
    d = decide([node(0, ttft_p90_s=1.8, ttft_samples=40, **LIGHT)], Planner(cfg(), metrics))
    assert "'measured': {'ttft_p90_s': 1.8, 'ttft_samples': 40" in d.describe()
    wire = inputs_of(d)  # GET /planner's typed inputs
    assert wire.measured is not None and (wire.measured.ttft_p90_s, wire.measured.counted) == (
        1.8,
        ["ttft"],
    )
    assert "measured TTFT P90 1.80 s (40 samples), counted: ttft" in describe_inputs(
        wire
    )  # the console's line
    text = generate_latest(metrics.registry).decode()
    assert (
        'duet:planner_measured_ttft_seconds{model="m",pool="interactive",role="prefill"} 1.8'
        in text
    )
    # too few samples: the series goes (a stale figure must not read as current)
    metrics2 = PlannerMetrics()
    decide([node(0, ttft_p90_s=1.8, ttft_samples=5, **LIGHT)], Planner(cfg(), metrics2))
    assert "duet:planner_measured_ttft_seconds{" not in generate_latest(metrics2.registry).decode()


def test_min_latency_samples_is_configurable() -> None:
    d = decide(
        [node(0, ttft_p90_s=1.8, ttft_samples=5, **LIGHT)], Planner(cfg(min_latency_samples=5))
    )
    assert d.reason == Reason.TTFT_MEASURED
    with pytest.raises(ValueError, match="min_latency_samples"):
        cfg(min_latency_samples=0)


def test_a_window_that_began_before_the_last_step_is_not_counted() -> None:
    """After a scale-out the nodes' 30-s windows still hold the old size's latency: the next
    step waits until a whole window was measured at the new size, not only the cool-down."""
    planner = Planner(cfg(cooldown_s=10, cold_start_s=0))
    slow = [
        node(0, ttft_p90_s=1.8, ttft_samples=40, **LIGHT),
        node(1, ttft_p90_s=1.8, ttft_samples=40, **LIGHT),
    ]
    first = decide(slow, planner)
    assert first.reason == Reason.TTFT_MEASURED
    t_step = 10.0  # the first tick whose window spans half of window_s
    seen: list[tuple[float, Reason, list[str]]] = []
    for k in range(1, 12):
        t = t_step + 5 * k
        d = next(d for d in planner.step(t, group(slow, t, 0.0)) if d.pool == P)
        seen.append((t, d.reason, d.inputs.get("measured", {}).get("counted")))  # type: ignore[union-attr]
        if d.direction == Direction.OUT:
            break
    assert seen[-1][1] == Reason.TTFT_MEASURED and seen[-1][0] >= t_step + 30, seen
    assert all(c == [] for _, r, c in seen[:-1] if r != Reason.NO_DATA), seen


def test_older_frames_without_measured_fields_decide_as_before() -> None:
    d = decide([replace(node(0, queued_prefill_tokens=6000), latency_window_s=0.0)])
    assert d.reason == Reason.TTFT and "measured" not in d.inputs


def test_recent_latency_window() -> None:
    now = [100.0]
    w = RecentLatency(window_s=30, max_samples=50, clock=lambda: now[0])
    assert w.p90() == (0.0, 0)
    for i in range(1, 11):  # 0.1 .. 1.0
        w.add(i / 10)
    assert w.p90() == (0.9, 10)
    now[0] += 20
    w.add(5.0)
    assert w.p90() == (1.0, 11)  # nearest rank: ceil(9.9) = 10th of 11
    now[0] += 15  # the first ten are 35 s old: out of the window
    assert w.p90() == (5.0, 1)
    for _ in range(80):
        w.add(0.01)
    assert w.p90() == (0.01, 50)  # only the newest max_samples are kept


# -- the pool's P90: the nodes' histograms merged ----------------------------------------------
def window(samples: list[float]) -> Window:
    """A node's real window (node/latency_window.py) holding `samples`."""
    w = RecentLatency(max_samples=len(samples) + 1, clock=lambda: 0.0)
    for x in samples:
        w.add(x)
    return w.window()


def ttft_node(i: int, samples: list[float], pool=P, **figures: float) -> NodeSample:
    """A node whose load frame carries its TTFT window: P90, count and histogram."""
    w = window(samples)
    return replace(
        node(i, pool, **figures), ttft_p90_s=w.p90_s, ttft_samples=w.samples, ttft_hist=w.hist
    )


def exact_p90(samples: list[float]) -> float:
    return sorted(samples)[nearest_rank(0.9, len(samples)) - 1]


def close(measured: float, exact: float) -> bool:
    return abs(measured - exact) <= RELATIVE_ERROR * exact


@dataclass
class Split:
    name: str
    a: list[float]  # node A's window
    b: list[float]  # node B's window
    direction: Direction
    reason: Reason


SPLITS = [
    # 1,000 requests, 20 % of them 2 s on node B: the pool's P90 is 2 s (the 900th is B's), the
    # mean of the P90s (0.8 × 0.05 + 0.2 × 2 = 0.44 s) would even step the pool in
    Split(
        "a slow node with a fifth of the samples holds the pool's tail",
        [0.05] * 800,
        [2.0] * 200,
        Direction.OUT,
        Reason.TTFT_MEASURED,
    ),
    # 5 % at 20 s: 95 % of the pool's requests take 50 ms, so its P90 meets the SLO; the mean of
    # the P90s (0.95 × 0.05 + 0.05 × 20 = 1.05 s) would step it out
    Split(
        "a slow node with a twentieth of the samples is under the pool's P90",
        [0.05] * 950,
        [20.0] * 50,
        Direction.IN,
        Reason.HEADROOM,
    ),
    # a pool whose P90 a mean of node P90s gets wrong: 900 at 50 ms and 100 at 2 s put the 900th
    # (the P90) at 50 ms
    Split(
        "900 at 50 ms and 100 at 2 s: the 900th is 50 ms",
        [0.05] * 900,
        [2.0] * 100,
        Direction.IN,
        Reason.HEADROOM,
    ),
]


@pytest.mark.parametrize("split", SPLITS, ids=[s.name for s in SPLITS])
def test_the_pool_p90_is_the_merged_distribution_not_a_mean_of_p90s(split: Split) -> None:
    nodes = [ttft_node(0, split.a, **LIGHT), ttft_node(1, split.b, **LIGHT)]
    m = group(nodes, 0.0, 60.0)[P].measured()
    pooled = exact_p90(split.a + split.b)
    mean_of_p90s = (exact_p90(split.a) * len(split.a) + exact_p90(split.b) * len(split.b)) / 1000
    assert (m.ttft_samples, m.ttft_merged_samples) == (1000, 1000)
    assert close(m.ttft_p90_s, pooled) and not close(m.ttft_p90_s, mean_of_p90s), (
        m,
        pooled,
        mean_of_p90s,
    )
    d = decide(nodes)
    assert (d.direction, d.reason) == (split.direction, split.reason), d.describe()
    assert d.inputs["measured"]["ttft_merged_samples"] == 1000  # type: ignore[index]


@pytest.mark.parametrize("seed", range(20))
def test_the_merged_p90_is_within_the_bucket_resolution_of_the_pooled_samples(seed: int) -> None:
    """Random pools of 1-4 nodes, each its own log-normal (medians 1 ms .. 20 s, windows of
    1..2,000 samples): the pool's P90 is within RELATIVE_ERROR (√1.1 − 1 ≈ 4.9 %) of the exact
    nearest-rank P90 of all the nodes' samples together."""
    rng = random.Random(seed)
    shapes = [
        (math.log(10 ** rng.uniform(-3, 1.3)), rng.uniform(0.05, 1.5), rng.randint(1, 2000))
        for _ in range(rng.randint(1, 4))
    ]  # (log median, sigma, samples) per node
    windows = [[rng.lognormvariate(mu, sigma) for _ in range(n)] for mu, sigma, n in shapes]
    m = group([ttft_node(i, w) for i, w in enumerate(windows)], 0.0, 60.0)[P].measured()
    pooled = [x for w in windows for x in w]
    assert m.ttft_samples == len(pooled)
    assert close(m.ttft_p90_s, exact_p90(pooled)), (m.ttft_p90_s, exact_p90(pooled))
    assert RELATIVE_ERROR < 0.05


def test_an_older_node_without_a_histogram_is_weighted_in_by_its_p90() -> None:
    """A rolling upgrade: node A sends its histogram, node B (older) only its P90: the pool's
    figure is the sample-weighted mean of A's merged P90 and B's P90; an unknown bucket scheme
    (a newer node) is read the same way; a pool of older nodes only is the former mean exactly."""
    a = ttft_node(0, [0.05] * 800)
    b = node(1, ttft_p90_s=2.0, ttft_samples=200)
    m = group([a, b], 0.0, 60.0)[P].measured()
    merged_a = group([a], 0.0, 60.0)[P].measured().ttft_p90_s
    assert close(merged_a, 0.05)
    assert (m.ttft_samples, m.ttft_merged_samples) == (1000, 800)
    assert m.ttft_p90_s == pytest.approx((merged_a * 800 + 2.0 * 200) / 1000)
    # GET /planner and the console say how much of the figure is older nodes' P90s
    wire = inputs_of(decide([replace(a, **LIGHT), replace(b, **LIGHT)]))  # type: ignore[arg-type]
    assert wire.measured is not None and (
        wire.measured.ttft_samples,
        wire.measured.ttft_merged_samples,
    ) == (1000, 800)
    assert "(1000 samples, 200 as node P90s)" in describe_inputs(wire)
    newer = replace(b, ttft_hist=LatencyHistogram(scheme=2, first=0, counts=[200]))
    assert group([a, newer], 0.0, 60.0)[P].measured() == m
    old = group(
        [node(0, ttft_p90_s=1.8, ttft_samples=12), node(1, ttft_p90_s=1.6, ttft_samples=36)],
        0.0,
        60.0,
    )
    assert (old[P].measured().ttft_p90_s, old[P].measured().ttft_merged_samples) == (
        pytest.approx(1.65),
        0,
    )


def test_the_histograms_keep_the_cold_start_and_min_samples_rules() -> None:
    slow = [2.0] * 40
    # a node whose window still reaches into its cold start: its histogram is left out too
    assert group([ttft_node(0, slow, started=-70.0)], 0.0, 60.0)[P].measured().ttft_samples == 0
    # 19 samples in histograms are as few as 19 P90 samples
    d = decide([ttft_node(0, [2.0] * 19, **LIGHT)])
    assert (d.direction, d.reason, d.inputs["measured"]["counted"]) == (
        Direction.HOLD,
        Reason.STEADY,
        [],
    )  # type: ignore[index]
    # an empty window (no request lately) adds nothing
    assert group([ttft_node(0, [])], 0.0, 60.0)[P].measured().ttft_samples == 0


def test_recent_latency_window_histogram() -> None:
    w = window([0.05] * 9 + [2.0])
    assert (w.p90_s, w.samples, w.hist.total) == (0.05, 10, 10)
    assert (
        w.hist.counts[0] == 9 and w.hist.counts[-1] == 1 and sum(1 for c in w.hist.counts if c) == 2
    )
    assert window([]).hist.counts == []
