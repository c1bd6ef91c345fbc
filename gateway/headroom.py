"""Which requests may start on the nodes while their quota reservation is still being booked.

Booking a reservation (a store transaction) used to sit between the request and its prefill
on every request's time to first token. For a team far from every limit the answer is known
in advance — yes — so the gateway sends the request to the nodes and books in parallel, and
nothing reaches the client before the booking says yes (serve.py waits for it before the
first byte of the answer). A refusal then costs the nodes an aborted request, never tokens
to the client or to the bill.

Invariants:
- a team is optimistic only when its last booking said every limit had room for at least
  `2 × (optimistic bookings in flight + 1)` more requests like it (`RateState.spare`): the
  factor 2 leaves room for other gateways and for requests larger than the last one;
- a team with no limit at all (`spare is None`) is always optimistic;
- a team never seen, refused last time, or near a limit books first, as before — a team
  flooding past its quota costs the nodes nothing;
- the table is bounded (`max_teams`; forgetting a team only makes it book first once).
"""

from __future__ import annotations

from gateway.store.base import Refusal, Reservation

#: a team whose last booking left `spare` ≥ this × (bookings in flight + 1) starts at once
MARGIN = 2


class Headroom:
    def __init__(self, enabled: bool = True, max_teams: int = 100_000) -> None:
        self.enabled = enabled
        self.max_teams = max_teams
        #: team → spare requests at its last booking (None: no limit); absent: book first
        self._spare: dict[str, int | None] = {}
        self._in_flight: dict[str, int] = {}

    def start(self, team_id: str) -> bool:
        """Whether this request may start before its booking; if so, call `done` with the
        booking's answer (or None when it failed) exactly once."""
        if not self.enabled or team_id not in self._spare:
            return False
        spare = self._spare[team_id]
        n = self._in_flight.get(team_id, 0)
        if spare is not None and spare < MARGIN * (n + 1):
            return False
        self._in_flight[team_id] = n + 1
        return True

    def done(self, team_id: str, answer: Reservation | Refusal | None) -> None:
        """An optimistic booking ended."""
        n = self._in_flight.get(team_id, 0) - 1
        if n > 0:
            self._in_flight[team_id] = n
        else:
            self._in_flight.pop(team_id, None)
        self.learn(team_id, answer)

    def learn(self, team_id: str, answer: Reservation | Refusal | None) -> None:
        """Any booking's answer: what the next request of the team may do."""
        if isinstance(answer, Reservation):
            if team_id not in self._spare and len(self._spare) >= self.max_teams:
                self._spare.pop(next(iter(self._spare)))
            self._spare[team_id] = answer.rate.spare
        else:  # refused, or the booking failed: the team books first until it has room again
            self._spare.pop(team_id, None)

    def optimistic_in_flight(self, team_id: str) -> int:
        return self._in_flight.get(team_id, 0)
