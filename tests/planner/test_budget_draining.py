"""Draining nodes count against the node budget: a victim keeps its machine until it is
stopped, so while one pool drains a node no other pool may step out onto that machine.

The old rule totalled only active replicas (planner/pools.py dropped draining nodes), so with a
budget of 4 a decode pool stepped out while a prefill victim was still draining: 5 machines.
"""

from __future__ import annotations

from planner.config import PlannerConfig, TierSLO
from planner.decide import Direction, Planner, Reason
from planner.pools import NodeSample, group
from planner.trace import parse_pool
from protocol.cluster import NodeStatus

P = parse_pool("prefill/smollm2-135m/interactive")
D = parse_pool("decode/smollm2-135m/interactive")


def _planner(budget: int, decode_min: int = 1) -> Planner:
    return Planner(
        PlannerConfig(
            interval_s=5,
            window_s=20,
            cooldown_s=30,
            reverse_cooldown_s=90,
            cold_start_s=60,
            default_max=4,
            node_budget=budget,
            bounds={"prefill": (1, 4), "decode": (decode_min, 4)},
            slo={"interactive": TierSLO(ttft_s=1.0, itl_s=0.15)},
        )
    )


def _nodes(now: float, *, victim_left: bool) -> list[NodeSample]:
    """2 P, one of them (p1) draining: the victim of a scale-in; and 1 D. All past their cold
    start."""
    old = now - 600
    nodes = [NodeSample("p0", P, old), NodeSample("d0", D, old)]
    if not victim_left:
        nodes.append(NodeSample("p1", P, old, status=NodeStatus.DRAINING))
    return nodes


def test_a_draining_node_still_counts_against_the_budget() -> None:
    now = 1000.0
    pools = group(_nodes(now, victim_left=False), now, 60)
    assert (pools[P].replicas, pools[P].draining, pools[P].candidates) == (1, 1, ["p0"])
    # the decode pool is below its min (2) and must step out — but p1 still holds its machine:
    # 3 machines in use of a budget of 3
    by_pool = {d.pool: d for d in _planner(budget=3, decode_min=2).step(now, pools)}
    assert (by_pool[D].direction, by_pool[D].reason) == (Direction.HOLD, Reason.BUDGET)
    assert by_pool[D].inputs["budget"] == {"total": 3, "limit": 3}
    # once the victim is stopped its machine is free for the decode pool
    freed = group(_nodes(now, victim_left=True), now, 60)
    by_pool = {d.pool: d for d in _planner(budget=3, decode_min=2).step(now, freed)}
    assert (by_pool[D].direction, by_pool[D].reason) == (Direction.OUT, Reason.BELOW_MIN)


def test_a_pool_whose_only_node_drains_is_below_its_min() -> None:
    now = 1000.0
    nodes = [
        NodeSample("p0", P, now - 600, status=NodeStatus.DRAINING),
        NodeSample("d0", D, now - 600),
    ]
    pools = group(nodes, now, 60)
    assert (pools[P].replicas, pools[P].draining, pools[P].candidates) == (0, 1, [])
    by_pool = {d.pool: d for d in _planner(budget=4).step(now, pools)}
    # a replacement is started (min 1 serving node) and the drained node is in the budget
    assert by_pool[P].direction == Direction.OUT and by_pool[P].reason == Reason.BELOW_MIN
    assert by_pool[P].inputs["budget"] == {"total": 2, "limit": 4}
