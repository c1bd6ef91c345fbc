"""Headroom in a saturated tier: a few slots kept free of a team over its fair share while
another team that asked recently holds less than its own.

Least attained service (fair_queue.py) orders the waiters, but it acts only when a slot frees:
a team that floods the tier takes every slot as it frees, and another team's request, arriving
at a full tier, waits for the next one to free however little that team holds. Headroom keeps
a few slots (`[tiers] fair_headroom`) out of the over-share team's reach while such a team is
active, so that its next request finds a free slot at once. The tier is not work conserving
then, but only while another team is active and under its share: a team alone, or beside teams
at their shares, may take every slot.

Terms, per tier (`Headroom.grant` decides with them):
- a team is *active* while it waits for a slot or asked for one within `active_s` seconds;
- its *share* is the tier's slots times its weight over the active teams' total weight;
- it is *within its share* when one more slot leaves it holding no more than its share;
- its *room* is how many more slots it could take within its share (share less held, floored,
  never below 0);
- the headroom *held against* a team is the least of `headroom` and the other active teams'
  room.

Invariants:
- a team may take a free slot while more slots than the headroom held against it are free
  (`Grant.SPARE`), or while it is within its share (`Grant.WITHIN_SHARE`); else it waits
  (`Grant.HELD`);
- every team beyond its share gets the same answer (its own room is none, so the headroom held
  against it is the same sum): when one team's waiters are held, so are every such team's, and
  a request that starts while others are held belongs to a team within its share;
- `headroom` 0 holds nothing: the tier is work conserving (the order before headroom).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Mapping


class Grant(enum.Enum):
    """Whether a team's request may take a free slot, and why (in the order they are tried)."""

    #: more slots are free than the headroom held against the team
    SPARE = "spare"
    #: the free slots are headroom, but the team holds less than its share: it may take one
    WITHIN_SHARE = "within_share"
    #: the free slots are the headroom of another active team under its share: wait
    HELD = "held"

    @property
    def starts(self) -> bool:
        return self is not Grant.HELD


class Headroom:
    """One tier's headroom policy: which teams asked when, and at what weight."""

    def __init__(self, slots: int, headroom: int, active_s: float) -> None:
        self.slots = slots
        self.headroom = headroom
        self.active_s = active_s
        #: team → (when it last asked for a slot, its weight then)
        self._asked: dict[str, tuple[float, float]] = {}

    def asked(self, team: str, weight: float, now: float) -> None:
        """`team` asks for a slot now (whether it gets one at once or waits)."""
        if self.headroom:  # without headroom nothing reads it: no per-request bookkeeping
            self._asked[team] = (now, weight)

    def _active(self, waiting: Collection[str], now: float) -> dict[str, float]:
        """The active teams' weights; teams no longer active are forgotten."""
        out: dict[str, float] = {}
        lapsed = []
        for team, (at, weight) in self._asked.items():
            if team in waiting or now - at < self.active_s:
                out[team] = weight
            else:
                lapsed.append(team)
        for team in lapsed:
            del self._asked[team]
        return out

    def grant(
        self,
        team: str,
        free: int,
        running: Mapping[str, int],
        waiting: Collection[str],
        now: float,
    ) -> Grant:
        """May `team` (which asked, `asked`) take one of the `free` slots (at least one), given
        each team's slots held in this tier (`running`) and the teams waiting in it?"""
        if free > self.headroom:  # more free than any headroom (or none): no need to weigh
            return Grant.SPARE
        active = self._active(waiting, now)
        total = sum(active.values())
        room, within = 0, False
        for t, weight in active.items():
            share = self.slots * weight / total
            held = running.get(t, 0)
            if t == team:
                within = held + 1 <= share
            else:
                room += max(0, math.floor(share - held))
        if free - 1 >= min(self.headroom, room):
            return Grant.SPARE
        return Grant.WITHIN_SHARE if within else Grant.HELD

    def lapses(self, waiting: Collection[str], now: float) -> float | None:
        """When the first team active `now` that does not wait stops being active (its room
        then stops being held), or None when there is none."""
        ends = [
            t0 + self.active_s
            for team, (t0, _) in self._asked.items()
            if team not in waiting and now - t0 < self.active_s
        ]
        return min(ends, default=None)
