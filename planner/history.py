"""The planner's recent decisions, kept for `GET /planner` (protocol/planner.py) and the
console's Cluster page: a bounded ring in the replica's memory (the metrics say how often, this
says when, why and from which figures).

Kept: every step (out / in), with the actuator's outcome once it answers; and a blocked hold
(cooldown, budget, at_bound, cold_start, actuating) only when it starts a run — the same pool
held for the same reason tick after tick is one entry, so a quiet hour does not push the steps
out of the ring. Steady and no-data holds are in the pool states, not in the ring.
"""

from __future__ import annotations

import logging
from collections import deque

import msgspec

from planner.actuator import ActResult
from planner.decide import Decision, Direction, Reason
from planner.pools import PoolKey
from protocol.planner import DecisionInputs, PlannerDecision, PoolState

log = logging.getLogger("duet.planner")
#: holds worth an entry: a step was wanted (or the planner could not look) and did not happen
KEPT_HOLDS = frozenset(
    {Reason.COOLDOWN, Reason.BUDGET, Reason.AT_BOUND, Reason.COLD_START, Reason.ACTUATING}
)


def inputs_of(d: Decision) -> DecisionInputs:
    """The decision's figures, typed; a figure the wire does not know is left out (logged once)."""
    try:
        return msgspec.convert(d.inputs, DecisionInputs)
    except (
        msgspec.ValidationError
    ) as e:  # a planner change the wire has not followed: keep the step
        log.warning(
            "planner decision inputs do not fit protocol.planner.DecisionInputs (%s): %s",
            e,
            d.inputs,
        )
        return DecisionInputs(replicas=d.current)


class DecisionLog:
    def __init__(self, maxlen: int = 200) -> None:
        self.maxlen = maxlen
        self.entries: deque[PlannerDecision] = deque(maxlen=maxlen)
        self.pools: dict[PoolKey, PoolState] = {}
        self.last_tick: float | None = None
        self._seq = 0
        #: per pool: the (direction, reason) of its last entry, so a run of holds is one entry
        self._last: dict[PoolKey, tuple[Direction, Reason]] = {}

    def tick(self, at: float, decisions: list[Decision]) -> None:
        self.last_tick = at
        self.pools = {
            d.pool: PoolState(
                role=d.pool.role,
                model=d.pool.model,
                tier=d.pool.tier,
                current=d.current,
                desired=d.desired,
                direction=str(d.direction),
                reason=str(d.reason),
            )
            for d in decisions
        }
        for d in decisions:
            self.add(at, d)

    def add(self, at: float, d: Decision) -> PlannerDecision | None:
        key = (d.direction, d.reason)
        if d.direction == Direction.HOLD and d.reason not in KEPT_HOLDS:
            self._last.pop(d.pool, None)  # a steady pool: the next blocked hold starts a new run
            return None
        if d.direction == Direction.HOLD and self._last.get(d.pool) == key:
            return None
        self._last[d.pool] = key
        self._seq += 1
        e = PlannerDecision(
            seq=self._seq,
            at=at,
            role=d.pool.role,
            model=d.pool.model,
            tier=d.pool.tier,
            direction=str(d.direction),
            reason=str(d.reason),
            current=d.current,
            desired=d.desired,
            victim=d.victim,
            inputs=inputs_of(d),
        )
        self.entries.append(e)
        return e

    def acted(self, pool: PoolKey, r: ActResult) -> None:
        """The actuator's answer to the pool's step in flight (one per pool at a time): set on
        the pool's newest step without an outcome."""
        for i in range(len(self.entries) - 1, -1, -1):
            e = self.entries[i]
            if (e.role, e.model, e.tier) == (
                pool.role,
                pool.model,
                pool.tier,
            ) and e.direction != Direction.HOLD:
                if e.outcome is None:
                    self.entries[i] = msgspec.structs.replace(
                        e, outcome=str(r.outcome), detail=r.detail
                    )
                return

    def newest(self, limit: int | None = None) -> list[PlannerDecision]:
        out = list(reversed(self.entries))
        return out[:limit] if limit is not None else out
