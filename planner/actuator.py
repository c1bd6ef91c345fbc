"""The one interface every actuator implements (local processes, Kubernetes, virtual), and
what it answers.

An actuator is handed one step at a time by planner/loop.py and owns its whole execution:
- `scale_out(pool, to)`: add one replica (returns once the platform accepted it; the node's
  cold start is the planner's business, not the actuator's);
- `scale_in(pool, victim, to)`: drain `victim` (planner/drain.py: no new routes, finish the
  prefills and streams, wait until every held KV block was pulled or its lease ran out; past the
  drain deadline its streams migrate) and only then remove it.

Before deciding, the planner asks `ready()`: an actuator that cannot act yet (the local one
while `duet up` still starts its processes) says why, and the planner holds every pool until it
can — a step decided then could only fail, and its cool-down would delay the real one.

A refused step (the platform said no: 403, 409, a budget of its own) is an `Outcome`, never an
exception: the loop records it in `duet:planner_actuations_total` and the planner tries again
after its cool-down.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from planner.pools import PoolKey


class Outcome(enum.StrEnum):
    DONE = "done"
    #: the platform refused the step (RBAC 403, conflict 409, no CPU left ...)
    REFUSED = "refused"
    #: the step failed part way (API unreachable, a process that did not start)
    FAILED = "failed"


@dataclass(frozen=True)
class Victim:
    node_id: str
    #: the node's base URL (its drain endpoint is `url + "/drain"`)
    url: str


@dataclass(frozen=True)
class ActResult:
    outcome: Outcome
    detail: str = ""
    #: the replica count the platform reports after the step, when it says
    replicas: int | None = None
    #: scale-in: the victim was idle when it was removed (False: the drain deadline passed)
    drained: bool | None = None


class Actuator(Protocol):
    #: "local" | "kubernetes" | "virtual" (the metrics' `actuator` label)
    name: str

    async def ready(self) -> str | None:
        """None when the actuator can act; else why not (`duet up` still starting): the planner
        then decides nothing, rather than hand a step to an actuator that can only fail it."""
        ...

    async def scale_out(self, pool: PoolKey, to: int) -> ActResult: ...

    async def scale_in(self, pool: PoolKey, victim: Victim, to: int) -> ActResult: ...

    async def close(self) -> None: ...
