"""Scale-in of a prefill pool asks what n − 1 nodes would be: queues alone cannot say it, so
the nodes' busy fractions (load frames' `busy`, node/busy_window.py) are spread over n − 1 and
each survivor must stay under (1 − margin) × busy_high (planner/predict.py `too_busy`).

The live run that found it (`duet up --autoscale`, 512-token prompts at 1.6 req/s on one CPU
thread per node, 05 Dec): three prefill nodes ~35 % busy each showed empty queues, so the
planner went 3 → 2 → 1 inside the load step, and TTFT P90 went from 2 s to 10 s. Each case is
decided by the real Planner on a virtual clock."""

from __future__ import annotations

import pytest

from planner.config import PlannerConfig, TierSLO
from planner.decide import Decision, Direction, Planner, Reason
from planner.history import inputs_of
from planner.pools import NodeSample, PoolKey, group
from planner.trace import parse_pool

P = parse_pool("prefill/m/interactive")
D = parse_pool("decode/m/interactive")
OLD = -1e9  # started long before: warm


def cfg(**kw: object) -> PlannerConfig:
    base = dict(
        interval_s=5,
        window_s=20,
        cooldown_s=10,
        reverse_cooldown_s=90,
        cold_start_s=0,
        default_max=4,
        slo={"interactive": TierSLO(ttft_s=2.0, itl_s=0.5)},
    )
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def nodes(n: int, pool: PoolKey = P, **figures: object) -> list[NodeSample]:
    """n warm nodes with empty queues (a pool that keeps up) and `figures`."""
    return [
        NodeSample(f"{pool.role}-{i}", pool, OLD, latency_window_s=30.0, **figures)
        for i in range(n)
    ]  # type: ignore[arg-type]


def decide(samples: list[NodeSample], planner: Planner | None = None, t0: float = 0.0) -> Decision:
    planner = planner or Planner(cfg())
    for k in range(10):
        t = t0 + 5 * k
        d = next(
            d
            for d in planner.step(t, group(samples, t, planner.cfg.cold_start_s))
            if d.pool == samples[0].pool
        )
        if d.reason != Reason.NO_DATA:
            return d
    raise AssertionError("no decision")


def test_survivors_that_would_be_too_busy_hold_the_pool() -> None:
    # 3 × 0.4 = 1.2 node-seconds a second: 0.6 each at n − 1, over 0.7 × 0.8 = 0.56
    d = decide(nodes(3, busy=0.4))
    assert (d.direction, d.reason) == (Direction.HOLD, Reason.STEADY), d.describe()
    assert d.inputs["at_n_minus_1"]["busy"] == pytest.approx(0.6)  # type: ignore[index]
    assert d.inputs["load"]["busy_sum"] == pytest.approx(1.2)  # type: ignore[index]
    wire = inputs_of(d)  # GET /planner shows the figure
    assert wire.at_n_minus_1 is not None and wire.at_n_minus_1.busy == pytest.approx(0.6)
    assert wire.load is not None and wire.load.busy_sum == pytest.approx(1.2)


def test_survivors_with_room_let_it_scale_in() -> None:
    d = decide(nodes(3, busy=0.25))  # 0.375 each at n − 1
    assert (d.direction, d.reason) == (Direction.IN, Reason.HEADROOM), d.describe()


@pytest.mark.parametrize("busy_high, direction", [(0.8, Direction.HOLD), (1.0, Direction.IN)])
def test_busy_high_is_the_operators_bound(busy_high: float, direction: Direction) -> None:
    assert decide(nodes(3, busy=0.4), Planner(cfg(busy_high=busy_high))).direction == direction


def test_a_pool_with_a_node_that_reports_no_busy_fraction_is_judged_by_its_queues() -> None:
    samples = nodes(3, busy=0.4)
    samples[1] = NodeSample(
        "prefill-1", P, OLD, latency_window_s=30.0
    )  # an older node, or a vLLM one
    d = decide(samples)
    assert d.direction == Direction.IN and "busy_sum" not in d.inputs["load"]  # type: ignore[operator]


def test_a_decode_pools_busy_fraction_does_not_hold_it() -> None:
    # a decode node steps whenever a sequence decodes: always busy, yet batching absorbs more
    d = decide(nodes(3, D, busy=1.0, running=1))
    assert (d.direction, d.reason) == (Direction.IN, Reason.HEADROOM), d.describe()


def test_a_node_claiming_more_than_all_its_time_counts_as_fully_busy() -> None:
    d = decide(nodes(3, busy=7.0))  # not a fraction: read as 1.0 each, not 7
    assert d.inputs["load"]["busy_sum"] == pytest.approx(3.0)  # type: ignore[index]


def test_after_a_scale_in_the_next_one_waits_for_windows_at_the_new_size() -> None:
    """Right after 3 → 2 the survivors' 30-s windows still average in the time when the leaver
    carried its share: the next scale-in waits until a whole window was measured at 2, even
    past the cool-down, and then goes only if 1 node could carry the load."""
    planner = Planner(cfg())
    first = decide(nodes(3, busy=0.1), planner)
    assert first.direction == Direction.IN
    t_step = 10.0  # the first tick whose window spans half of window_s (as decide() ran)
    two = nodes(2, busy=0.12)  # 0.24 at n − 1: would pass on its own
    seen = []
    for k in range(1, 12):
        t = t_step + 5 * k
        d = next(d for d in planner.step(t, group(two, t, 0.0)) if d.pool == P)
        seen.append((t, d.direction, d.reason))
        if d.direction == Direction.IN:
            break
    assert seen[-1][1] == Direction.IN and seen[-1][0] >= t_step + 30, seen


def test_the_console_line_names_the_busy_figures() -> None:
    from gateway.console.autoscaler import describe_inputs

    line = describe_inputs(inputs_of(decide(nodes(3, busy=0.4))))
    assert "busy 1.20 nodes" in line and "at 2: " in line and "60% busy each" in line


@pytest.mark.parametrize("bad", [0.0, -0.5, 1.5])
def test_busy_high_outside_0_1_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="busy_high"):
        cfg(busy_high=bad)
