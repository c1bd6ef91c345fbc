"""Refusals that need no tokenizer and no store: a team's concurrency and requests-per-minute
limits, checked on this gateway's own counts before a prompt is tokenized, so a team at its
limit cannot make the gateway spend CPU on prompts it will refuse anyway.

Invariant: the counts here are this gateway's requests only. The concurrency count is a lower
bound of the team's count in the store (which every gateway shares); the requests-per-minute
window counts every request this gateway started work on (`started`, right after `check`),
including those refused later — by the tokenizer, the context check or the store — since each
cost CPU: a team cannot loop free requests that fail after the gate. The store's reservation
stays the authority for everything that passes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from gateway.accounts.store.base import Team
from protocol.openai import APIError

WINDOW_S = 60.0


class TeamLimited(APIError):
    """The same answer as the store's refusal (ledger.RateLimited), so clients see one 429; the
    batch executor defers the line, as for the store's."""


def _refuse(kind: str, message: str, retry_after_s: float, headers: dict[str, str]) -> TeamLimited:
    return TeamLimited(
        429,
        message,
        type_="rate_limit_error",
        code="rate_limit_exceeded",
        param=kind,
        retry_after_s=max(1, math.ceil(retry_after_s)),
        headers=headers,
    )


class TeamGate:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._active: dict[str, int] = {}
        self._starts: dict[str, deque[float]] = {}

    def check(self, team: Team, default_max_concurrent: int) -> None:
        """Raise the 429 the store would give, when this gateway alone already fills a limit."""
        limit = (
            team.max_concurrent
            if team.max_concurrent is not None
            else (default_max_concurrent or None)
        )
        active = self._active.get(team.id, 0)
        if limit is not None and active >= limit:
            raise _refuse(
                "concurrency",
                f"team {team.id!r} already has {active} requests in flight (limit {limit})",
                1.0,
                {},
            )
        if team.rpm is not None and (q := self._starts.get(team.id)):
            now = self.clock()
            while q and q[0] <= now - WINDOW_S:
                q.popleft()
            if len(q) >= team.rpm:
                reset = q[0] + WINDOW_S - now
                raise _refuse(
                    "requests",
                    f"rate limit reached for team {team.id!r}: {team.rpm} requests per minute",
                    reset,
                    {
                        "x-ratelimit-limit-requests": str(team.rpm),
                        "x-ratelimit-remaining-requests": "0",
                    },
                )

    def started(self, team: Team) -> None:
        """A request of the team passed `check`: it counts in the window from now on."""
        if team.rpm is None:
            self._starts.pop(team.id, None)
            return
        q = self._starts.setdefault(team.id, deque())
        q.append(self.clock())
        while len(q) > team.rpm:  # only the newest rpm starts can matter
            q.popleft()

    @contextlib.contextmanager
    def running(self, team_id: str) -> Iterator[None]:
        self._active[team_id] = self._active.get(team_id, 0) + 1
        try:
            yield
        finally:
            n = self._active[team_id] - 1
            if n:
                self._active[team_id] = n
            else:
                del self._active[team_id]
