"""The transactions every request makes on the SQLite store's tables of keys, teams, quotas and
usage (their schema and row mappers: sqlite_tables.py) — the reservation, its settlement and
usage record, the expiry of lapsed bookings — as functions of a connection, run by sqlite.py's
`SqliteStore` on the loop's fast path or the worker thread.
"""

from __future__ import annotations

import secrets
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from gateway.accounts.store.base import (
    N_TEAM_COLS,
    TEAM_COLS,
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    StoreError,
    UsageKey,
)
from gateway.accounts.store.expiry import (
    Booking,
    booked_from,
    booked_json,
    expired_record,
)
from gateway.accounts.store.rules import Counters, day_period, decide, month_period, window_start
from gateway.accounts.store.sqlite_conn import Immediate
from gateway.accounts.store.sqlite_tables import team_of
from gateway.accounts.store.sqlite_usage import write_usage
from gateway.accounts.store.usage_keys import mode_of


def settler(batch: list[Settlement]) -> Callable[[sqlite3.Connection], None]:
    """The transaction that settles `batch` and writes its usage records (safe to run twice:
    it commits once or not at all). A booking that expired before its settlement (its gateway
    looked dead, or it outlived its TTL unrenewed) was billed `expired`, under its request id as
    a key: its real record replaces that one (usage_keys.py)."""

    def q(db: sqlite3.Connection) -> None:
        now = time.time()
        with Immediate(db):
            for s in batch:
                b = _settle_booking(db, s, now)
                if b is not Booking.RECORDED:
                    write_usage(db, s.record, now, mode_of(s.key, b is Booking.GONE))

    return q


#: a team's row, every counter a reservation decides on, and the soonest expiry of any booking
#: (args: window start, team, day period, month period)
_COUNTERS = f"""
SELECT {", ".join("t." + c.strip() for c in TEAM_COLS.split(","))},
       s.active, s.active_cost_usd, b.n, b.tokens, b.oldest, d.cost_usd, m.cost_usd,
       (SELECT min(expires_at) FROM reservations) AS soonest
FROM teams t
LEFT JOIN team_state s ON s.team_id = t.id
LEFT JOIN (SELECT coalesce(sum(requests), 0) AS n, coalesce(sum(tokens), 0) AS tokens,
                  min(second) AS oldest
           FROM rate_buckets WHERE team_id = ?2 AND second >= ?1) b ON 1
LEFT JOIN spend d ON d.team_id = t.id AND d.period = ?3
LEFT JOIN spend m ON m.team_id = t.id AND m.period = ?4
WHERE t.id = ?2"""


def reserve_in(db: sqlite3.Connection, req: ReserveRequest) -> Reservation | Refusal:
    now = req.now
    with Immediate(db):
        # Every counter in one query: this transaction is on each request's path to its first
        # token. Lapsed bookings must not count; the query says (from the expiry index) whether
        # there are any, so the common case costs no DELETE that finds nothing.
        args = (window_start(now), req.team_id, day_period(now), month_period(now))
        row = db.execute(_COUNTERS, args).fetchone()
        if row is not None and row[-1] is not None and row[-1] <= now:
            expire_where(
                db, "expires_at<=?", (now,), now
            )  # every lapsed booking, as the sweeper would
            row = db.execute(_COUNTERS, args).fetchone()
        if row is None:
            raise StoreError(403, f"team {req.team_id!r} no longer exists")
        team = team_of(row[:N_TEAM_COLS])
        counters = row[N_TEAM_COLS : N_TEAM_COLS + 7]
        active, active_cost, n_requests, n_tokens, oldest, spent_day, spent_month = counters
        c = Counters(
            active=active or 0,
            active_cost=active_cost or 0.0,
            window_requests=n_requests,
            window_tokens=n_tokens,
            window_oldest=float(oldest + 1) if oldest is not None else None,
            spent_day=spent_day or 0.0,
            spent_month=spent_month or 0.0,
        )
        verdict = decide(team, c, req)
        if (
            isinstance(verdict, Refusal) and verdict.kind == "tokens"
        ):  # its Retry-After needs the buckets
            buckets = db.execute(
                "SELECT second, tokens FROM rate_buckets WHERE team_id=? AND second>=? "
                "ORDER BY second",
                (team.id, window_start(now)),
            ).fetchall()
            verdict = decide(team, c, req, [(float(b[0] + 1), b[1]) for b in buckets])
        if isinstance(verdict, Refusal):
            return verdict
        rid = f"rsv-{secrets.token_hex(16)}"
        db.execute(
            "INSERT INTO reservations (id, team_id, key_id, request_id, created_at, expires_at, "
            "tokens, cost_usd, gateway_id, booked) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                rid,
                team.id,
                req.key_id,
                req.request_id,
                now,
                now + req.ttl_s,
                req.tokens,
                req.cost_usd,
                req.gateway_id or None,
                booked_json(req.booked),
            ),
        )
        db.execute(
            "INSERT INTO team_state (team_id, active, active_cost_usd) VALUES (?, 1, ?) "
            "ON CONFLICT (team_id) DO UPDATE SET active = active + 1, active_cost_usd = "
            "active_cost_usd + excluded.active_cost_usd",
            (team.id, req.cost_usd),
        )
        _bucket(db, team.id, int(now), 1, req.tokens)
        return Reservation(rid, verdict)


def _bucket(db: sqlite3.Connection, team_id: str, second: int, requests: int, tokens: int) -> None:
    db.execute(
        "INSERT INTO rate_buckets (team_id, second, requests, tokens) VALUES (?,?,?,?) "
        "ON CONFLICT (team_id, second) DO UPDATE SET requests = requests + excluded.requests, "
        "tokens = tokens + excluded.tokens",
        (team_id, second, requests, tokens),
    )


def _unbook(db: sqlite3.Connection, team_id: str, cost: float) -> None:
    """Take a booking whose row the caller deleted out of the in-flight counters (its window
    tokens are the caller's)."""
    db.execute(
        "UPDATE team_state SET active = active - 1, active_cost_usd = CASE WHEN active <= 1 THEN 0 "
        "ELSE active_cost_usd - ? END WHERE team_id=?",
        (cost, team_id),
    )


def expire_where(
    db: sqlite3.Connection, where: str, args: tuple[Any, ...], now: float | None = None
) -> int:
    """Bookings whose gateway never settled them stop counting: in flight and in the window;
    each bills its booked prompt and the tokens it had streamed as of its gateway's last
    heartbeat (an `expired` usage record, the day's and month's spend)."""
    now = time.time() if now is None else now
    rows = db.execute(
        f"DELETE FROM reservations WHERE {where} RETURNING team_id, key_id, request_id, "
        "created_at, tokens, cost_usd, booked, streamed_tokens",
        args,
    ).fetchall()
    for team_id, key_id, request_id, created, tokens, cost, booked, streamed in rows:
        _unbook(db, team_id, cost)
        b = booked_from(booked)
        record = expired_record(team_id, key_id, request_id, b, now, streamed)
        # the window keeps what was billed, as a settled request's does (prompt + completion)
        _bucket(
            db,
            team_id,
            int(created),
            0,
            (record.prompt_tokens + record.completion_tokens if record else 0) - tokens,
        )
        if record is not None:
            # keyed by its request id, always: if the request still settles (its gateway was
            # alive after all), its real record replaces this one (usage_keys.py)
            write_usage(db, record, now, UsageKey.RERUN)
    return len(rows)


def _settle_booking(db: sqlite3.Connection, s: Settlement, now: float) -> Booking:
    """The booking's worst case becomes the request's real tokens, in the second it was booked."""
    row = None
    if s.reservation_id is not None:
        row = db.execute(
            "DELETE FROM reservations WHERE id=? RETURNING team_id, created_at, tokens, cost_usd",
            (s.reservation_id,),
        ).fetchone()
    r = s.record
    # gone: was it this very settlement? (the record's own team, time and id: on the usage
    # index, and a retry carries the same)
    if (
        row is None
        and s.reservation_id is not None
        and db.execute(
            "SELECT 1 FROM usage WHERE team_id=? AND created_at=? AND request_id=?",
            (r.team_id, r.created_at, r.request_id),
        ).fetchone()
    ):
        return Booking.RECORDED
    if row is None:  # nothing booked, or it expired meanwhile: the real tokens count from now
        if s.tokens:
            _bucket(db, r.team_id, int(now), 0, s.tokens)
        return Booking.SETTLED if s.reservation_id is None else Booking.GONE
    team_id, created, booked, cost = row
    _unbook(db, team_id, cost)
    _bucket(db, team_id, int(created), 0, s.tokens - booked)
    return Booking.SETTLED
