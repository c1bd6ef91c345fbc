"""Load mode's decisions replayed against recorded load traces (tests/planner/traces, virtual
clock): scale-out, scale-in with the N−1 prediction, the node budget, cold start ignored, and no
flapping on a noisy 10-minute step."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from planner.config import PlannerConfig, TierSLO
from planner.decide import Direction, Planner, Reason
from planner.metrics import PlannerMetrics
from planner.trace import Replay, load_trace, parse_pool

TRACES = Path(__file__).parent / "traces"
P = parse_pool("prefill/smollm2-135m/interactive")
PB = parse_pool("prefill/smollm2-135m/batch")


def cfg(**kw: object) -> PlannerConfig:
    base = dict(
        interval_s=5,
        window_s=20,
        cooldown_s=30,
        reverse_cooldown_s=90,
        cold_start_s=60,
        default_max=3,
        slo={
            "interactive": TierSLO(ttft_s=1.0, itl_s=0.15),
            "batch": TierSLO(ttft_s=30.0, itl_s=1.0),
        },
    )
    base.update(kw)
    return PlannerConfig(**base)  # type: ignore[arg-type]


def replay(name: str, **kw: object) -> Replay:
    return Replay(Planner(cfg(**kw)), load_trace(TRACES / name)).run()


def test_scale_out_when_the_pool_is_predicted_to_miss_its_ttft_slo() -> None:
    r = replay("scale_out.jsonl")
    steps = r.steps(P)
    assert [d.direction for _, d in steps] == [Direction.OUT]
    t, d = steps[0]
    assert 60 <= t <= 60 + 30, t  # the queue rose at 60 s: within the window's half + a tick
    assert d.reason == Reason.TTFT and d.current == 1 and d.desired == 2
    assert d.inputs["at_n"]["ttft_s"] > 1.0  # type: ignore[index]


def test_cold_start_figures_are_ignored() -> None:
    """The added node reports a 50,000-token queue while it warms up: no second step for it."""
    r = replay("scale_out.jsonl")
    t_out = r.steps(P)[0][0]
    cold = [d for t, d in r.decisions if t_out < t < t_out + 60]
    assert cold and all(d.reason == Reason.COLD_START for d in cold)
    # once warm, its share of the real load fits: steady at 2
    assert r.sizes[-1][2] == 2
    # counting the cold node's figures would have scaled out again at once
    naive = replay("scale_out.jsonl", cold_start_s=0)
    assert len(naive.steps(P)) > 1


def test_scale_in_predicts_the_load_on_the_survivors() -> None:
    r = replay("scale_in.jsonl")
    steps = r.steps(P)
    assert [(d.direction, d.reason, d.desired) for _, d in steps] == [
        (Direction.IN, Reason.HEADROOM, 2)
    ]
    d = steps[0][1]
    assert d.victim is not None
    # at N−1 = 2 each survivor carries 900 queued tokens: under 0.7 × the SLO
    assert d.inputs["at_n_minus_1"]["ttft_s"] <= 0.7  # type: ignore[index]
    # at 2 the per-node figure is also under 0.7 × SLO, but one node alone would miss it: held
    last = [d for _, d in r.decisions][-1]
    assert last.current == 2 and last.direction == Direction.HOLD
    assert last.inputs["at_n"]["ttft_s"] <= 0.7 < last.inputs["at_n_minus_1"]["ttft_s"]  # type: ignore[index]
    assert r.sizes[-1][2] == 2


def test_the_node_budget_caps_every_pool_together_interactive_first() -> None:
    metrics = PlannerMetrics()
    r = Replay(Planner(cfg(node_budget=3), metrics), load_trace(TRACES / "budget.jsonl")).run()
    total = {}
    for t, _, n in r.sizes:
        total[t] = total.get(t, 0) + n
    assert max(total.values()) == 3
    assert [d.direction for _, d in r.steps(P)] == [Direction.OUT]
    assert r.steps(PB) == []
    assert any(d.pool == PB and d.reason == Reason.BUDGET for _, d in r.decisions)
    text = generate_latest(metrics.registry).decode()
    assert (
        'duet:planner_decisions_total{direction="hold",model="smollm2-135m",pool="batch",reason="budget",role="prefill"}'
        in text
    )
    assert (
        'duet:planner_desired_replicas{model="smollm2-135m",pool="batch",role="prefill"} 2.0'
        in text
    )
    # without a budget both pools grow
    free = replay("budget.jsonl")
    assert free.steps(PB)


def test_no_flapping_on_a_noisy_ten_minute_step() -> None:
    r = replay("noisy_step.jsonl")
    dirs = [d.direction for _, d in r.steps(P)]
    assert Direction.OUT in dirs and Direction.IN in dirs, dirs  # it follows the step both ways
    assert r.direction_changes(P) <= 2, [(t, d.direction, d.reason) for t, d in r.steps(P)]
    # out within 60 s of the step at 120 s
    assert 120 < r.steps(P)[0][0] <= 180
    # and back to one node after the load falls at 300 s
    assert r.sizes[-1][2] == 1
    # the same trace without the window, the margin and the cooldowns flaps
    bare = replay("noisy_step.jsonl", window_s=5, margin=0.0, cooldown_s=0, reverse_cooldown_s=0)
    assert bare.direction_changes(P) > 2


def test_bounds_win_and_cooldown_paces_steps() -> None:
    r = replay("scale_out.jsonl", bounds={"prefill": (2, 3)})
    first = r.decisions[0][1]
    assert (first.direction, first.reason) == (Direction.OUT, Reason.BELOW_MIN)
    capped = replay("scale_out.jsonl", bounds={"prefill": (1, 1)})
    assert capped.steps(P) == []
    assert any(d.reason == Reason.AT_BOUND for _, d in capped.decisions)
