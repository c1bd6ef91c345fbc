"""The quota decision, independent of the database: given a team's counters as read inside the
reservation's transaction, admit (with the x-ratelimit-* state) or refuse (with the limit
that refused and when to retry). Every store calls this one function, so SQLite and Postgres
refuse the same requests with the same words.

Order: concurrency, requests per minute, tokens per minute, daily budget, monthly budget.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.accounts.store.base import (
    WINDOW_S,
    LimitKind,
    RateState,
    Refusal,
    ReserveRequest,
    Team,
)


def day_period(t: float) -> str:
    return "d:" + time.strftime("%Y-%m-%d", time.gmtime(t))


def month_period(t: float) -> str:
    return "m:" + time.strftime("%Y-%m", time.gmtime(t))


def seconds_to_next_day(t: float) -> float:
    return 86400 - (t % 86400)


def seconds_to_next_month(t: float) -> float:
    g = time.gmtime(t)
    y, m = (g.tm_year + 1, 1) if g.tm_mon == 12 else (g.tm_year, g.tm_mon + 1)
    return calendar.timegm((y, m, 1, 0, 0, 0)) - t


@dataclass(frozen=True)
class Counters:
    """A team's state, read in the reservation's transaction (kept as running counters — per
    team in flight, per team and second in the window — so a reservation costs the same with
    ten thousand requests in flight as with one)."""

    active: int  # unsettled, unexpired reservations
    active_cost: float
    window_requests: int  # reservations in the rate window
    window_tokens: int  # their tokens: booked worst case while in flight, real ones once settled
    #: when the oldest bucket in the window leaves it, minus 60 s
    window_oldest: float | None
    spent_day: float
    spent_month: float


def window_start(now: float) -> int:
    """The first one-second rate bucket inside the 60 s window. Buckets are whole seconds, so
    the window is up to a second longer than 60 s: conservative, never an overspend."""
    return int(now - WINDOW_S)


def decide(
    team: Team, c: Counters, req: ReserveRequest, window_rows: list[tuple[float, int]] | None = None
) -> Refusal | RateState:
    """`window_rows`: (time the bucket leaves the window − 60 s, tokens), oldest first.

    On each request's path to its first token: no work for a limit the team does not have."""
    now = req.now
    reset = max(0.0, c.window_oldest + WINDOW_S - now) if c.window_oldest is not None else 0.0
    left_requests = None if team.rpm is None else max(0, team.rpm - c.window_requests)
    left_tokens = None if team.tpm is None else max(0, team.tpm - c.window_tokens)

    def rate(reset_tokens: float = reset) -> RateState:  # as of before this request
        return RateState(
            limit_requests=team.rpm,
            limit_tokens=team.tpm,
            remaining_requests=left_requests,
            remaining_tokens=left_tokens,
            reset_requests_s=reset,
            reset_tokens_s=reset_tokens,
        )

    concurrent = (
        team.max_concurrent
        if team.max_concurrent is not None
        else (req.default_max_concurrent or None)
    )
    if concurrent is not None and c.active >= concurrent:
        return Refusal(
            "concurrency",
            f"team {team.id!r} already has {c.active} requests in flight (limit {concurrent})",
            1.0,
            rate(),
        )
    if team.rpm is not None and c.window_requests >= team.rpm:
        return Refusal(
            "requests",
            f"rate limit reached for team {team.id!r}: {team.rpm} requests per minute",
            reset,
            rate(),
        )
    if team.tpm is not None and c.window_tokens + req.tokens > team.tpm:
        wait = _tokens_free_in(window_rows or [], now, c.window_tokens + req.tokens - team.tpm)
        if req.tokens > team.tpm:
            msg = (
                f"this request needs up to {req.tokens} tokens (prompt + max_tokens), more than "
                f"team {team.id!r}'s limit of {team.tpm} tokens per minute"
            )
        else:
            msg = (
                f"rate limit reached for team {team.id!r}: {team.tpm} tokens per minute, "
                f"{max(0, team.tpm - c.window_tokens)} left, this request needs up to {req.tokens}"
            )
        return Refusal("tokens", msg, wait, rate(wait))
    budgets: tuple[tuple[LimitKind, float | None, float, Callable[[float], float]], ...] = (
        ("daily_budget", team.daily_budget_usd, c.spent_day, seconds_to_next_day),
        ("monthly_budget", team.monthly_budget_usd, c.spent_month, seconds_to_next_month),
    )
    for kind, budget, spent, reset_at in budgets:
        if budget is None:
            continue
        committed = spent + c.active_cost
        if committed + req.cost_usd > budget:
            return Refusal(
                kind,
                f"team {team.id!r} would exceed its {kind.replace('_', ' ')} of ${budget:g} "
                f"(${committed:.6f} spent or reserved, this request may cost up to "
                f"${req.cost_usd:.6f})",
                reset_at(now),
                rate(),
            )
    # admitted: the headers count this request in
    return RateState(
        limit_requests=team.rpm,
        limit_tokens=team.tpm,
        remaining_requests=None if left_requests is None else left_requests - 1,
        remaining_tokens=None if left_tokens is None else left_tokens - req.tokens,
        reset_requests_s=reset,
        reset_tokens_s=reset,
    )


def _tokens_free_in(rows: list[tuple[float, int]], now: float, need: int) -> float:
    """Seconds until `need` booked tokens leave the 60 s window (rows oldest first)."""
    freed = 0
    for created, tokens in rows:
        freed += tokens
        if freed >= need:
            return max(0.0, created + WINDOW_S - now)
    return WINDOW_S
