"""One tier's admission queue, served by least attained service per team.

A saturated tier hands each freed slot to the waiting team that has received the least
service, not to the oldest waiter: a team's burst waits behind its own requests, not in front
of everyone's. Service is counted in tokens, in the manner of the Virtual Token Counter (Sheng
et al., "Fairness in Serving Large Language Models", OSDI 2024): each team has a counter that
grows by the prompt tokens of every request it gets a slot for and by its output tokens times
`output_weight` (an output token costs more than a prompt token) when the request ends, both
divided by the team's weight, so a team of weight 2 gets twice the tokens of a team of weight 1
while both wait.

Invariants:
- `pop` gives the head of the backlogged team with the lowest counter, among the teams its
  caller lets start (a team the tier's headroom holds back, headroom.py, is passed over and
  keeps its place); ties go to the team with fewer requests running (a team just lifted to
  another's counter is level with it in past service, not in present), then to the one whose
  head waited longest. Within a team, first come first served.
- A team that starts waiting is lifted to the lowest counter among the teams already waiting
  (to the counter of the last team served when none waits): idle time is not banked, so a team
  quiet for an hour cannot then hold the tier for an hour.
- A full queue sheds the team that fills it most (`make_room`), never a team that waits for
  fewer: a flood cannot lock the others out of the queue either.
- A request admitted without waiting is charged too (`admitted`), and every admitted request's
  output when it ends (`done`): the counters measure all the service the tier gave, and the
  queue orders only those that wait.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True)
class Claim:
    """Who asks for a slot: the team (authenticated, never a client header), its share weight
    (`share_weight`) and the prompt tokens its request holds."""

    team: str
    weight: float = 1.0
    tokens: int = 0


def share_weight(stored: float | None, configured: float) -> float:
    """A team's share weight: the one the admin API stored with the team (`PATCH
    /admin/teams/{id}`), else gateway.toml's `[teams.<id>] weight`. Read per request from the
    caller's team, so a change takes at the team's next request, without a restart."""
    return configured if stored is None else stored


@dataclass(eq=False)
class Waiter(Generic[T]):
    claim: Claim
    item: T
    seq: int = field(default=0)


class FairQueue(Generic[T]):
    """Waiters of one tier by team; see the module docstring for the order."""

    def __init__(self, output_weight: float = 2.0, by_team: bool = True) -> None:
        """`by_team` False: one queue for all, first come first served (fair shares off)."""
        self.output_weight = output_weight
        self._by_team = by_team
        #: each team's attained service, in weighted tokens (`served`)
        self._counters: dict[str, float] = {}
        self._waiting: dict[str, deque[Waiter[T]]] = {}
        self._seq = itertools.count()
        #: each team's requests holding a slot (a tie's breaker)
        self._running: dict[str, int] = {}
        self._last = 0.0
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def counter(self, team: str) -> float:
        return self._counters.get(team if self._by_team else "", 0.0)

    def waiting(self, team: str) -> int:
        return len(self._waiting.get(team if self._by_team else "", ()))

    def _key(self, claim: Claim) -> str:
        return claim.team if self._by_team else ""

    def key(self, team: str) -> str:
        """The name `team` is counted under here (every team is one when fair shares are off)."""
        return team if self._by_team else ""

    def running(self) -> Mapping[str, int]:
        """Each team's requests holding a slot of this tier (teams holding none left out)."""
        return self._running

    def teams_waiting(self) -> Collection[str]:
        return self._waiting.keys()

    def push(self, claim: Claim, item: T) -> Waiter[T]:
        team = self._key(claim)
        q = self._waiting.get(team)
        if q is None:  # newly backlogged: lifted, idle time is not banked
            floor = min((self._counters[t] for t in self._waiting), default=self._last)
            self._counters[team] = max(self._counters.get(team, 0.0), floor)
            q = self._waiting[team] = deque()
        w = Waiter(claim, item, next(self._seq))
        q.append(w)
        self._n += 1
        return w

    def pop(self, may_start: Callable[[str], bool] | None = None) -> Waiter[T] | None:
        """The next waiter to serve (charged its prompt), or None when nobody waits; with
        `may_start`, the next among the teams it admits (by `key`), None when it admits none."""
        teams: Collection[str] = self._waiting
        if may_start is not None:
            teams = [t for t in self._waiting if may_start(t)]
        if not teams:
            return None
        team = min(
            teams,
            key=lambda t: (self._counters[t], self._running.get(t, 0), self._waiting[t][0].seq),
        )
        q = self._waiting[team]
        w = q.popleft()
        if not q:
            del self._waiting[team]
        self._n -= 1
        self.admitted(w.claim)
        self._last = self._counters[team]
        return w

    def make_room(self, claim: Claim) -> Waiter[T] | None:
        """The queue is full and `claim` asks to wait: the newest waiter of the team with the
        most waiting (ties: the most served), taken out to be refused instead — unless that
        team waits no more than one request beyond `claim`'s own (then `claim` is refused: None)."""
        if not self._waiting:
            return None
        team = max(self._waiting, key=lambda t: (len(self._waiting[t]), self._counters[t]))
        if team == self._key(claim) or len(self._waiting[team]) <= self.waiting(claim.team) + 1:
            return None
        q = self._waiting[team]
        w = q.pop()
        if not q:
            del self._waiting[team]
        self._n -= 1
        return w

    def remove(self, w: Waiter[T]) -> bool:
        """Take back a waiter that gave up (timed out, cancelled); False if it was not waiting."""
        team = self._key(w.claim)
        q = self._waiting.get(team)
        if q is None or w not in q:
            return False
        q.remove(w)
        if not q:
            del self._waiting[team]
        self._n -= 1
        return True

    def admitted(self, claim: Claim) -> None:
        """`claim` got a slot (from `pop`, or at once): its team is charged its prompt."""
        self._charge(claim, claim.tokens, 1)

    def done(self, claim: Claim, output_tokens: int) -> None:
        """`claim`'s request ended, having served `output_tokens`: charged at their weight."""
        self._charge(claim, self.output_weight * output_tokens, -1)

    def refund(self, claim: Claim) -> None:
        """Take back `admitted` for a slot that came as its waiter gave up (never served)."""
        self._charge(claim, -claim.tokens, -1)

    def _charge(self, claim: Claim, tokens: float, running: int) -> None:
        team = self._key(claim)
        self._counters[team] = self._counters.get(team, 0.0) + tokens / claim.weight
        n = self._running.get(team, 0) + running
        if n > 0:
            self._running[team] = n
        else:
            self._running.pop(team, None)
