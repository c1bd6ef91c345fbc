"""The PostgreSQL store's tables of keys, teams, quotas and usage: their schema (and the tables
and columns later versions added), the row mappers, and the statements every request's
transactions run — booking, settling, the usage record, expiry — as functions of a connection,
run by postgres.py's `PostgresStore`.
"""

from __future__ import annotations

import secrets
from typing import Any

from gateway.accounts.store.base import (
    TEAM_COLS,
    ApiKey,
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    StoreError,
    Team,
    UsageKey,
)
from gateway.accounts.store.expiry import (
    Booking,
    booked_from,
    booked_json,
    expired_record,
)
from gateway.accounts.store.postgres_usage import write_usage
from gateway.accounts.store.rules import Counters, day_period, decide, month_period, window_start

SCHEMA = """
CREATE TABLE IF NOT EXISTS teams (
    id TEXT PRIMARY KEY, rpm BIGINT, tpm BIGINT, max_concurrent BIGINT,
    daily_budget_usd DOUBLE PRECISION, monthly_budget_usd DOUBLE PRECISION,
    default_tier TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, weight DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, name TEXT NOT NULL, prefix TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE, created_at DOUBLE PRECISION NOT NULL,
    revoked_at DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, key_id TEXT NOT NULL, request_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL,
    tokens BIGINT NOT NULL,
    cost_usd DOUBLE PRECISION NOT NULL, gateway_id TEXT, booked TEXT,
    streamed_tokens BIGINT NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS reservations_team_expiry ON reservations (team_id, expires_at);
CREATE INDEX IF NOT EXISTS reservations_expiry ON reservations (expires_at);
CREATE TABLE IF NOT EXISTS team_state (
    team_id TEXT PRIMARY KEY, active BIGINT NOT NULL, active_cost_usd DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS rate_buckets (
    team_id TEXT NOT NULL, second BIGINT NOT NULL, requests BIGINT NOT NULL, tokens BIGINT NOT NULL,
    PRIMARY KEY (team_id, second));
CREATE TABLE IF NOT EXISTS spend (
    team_id TEXT NOT NULL, period TEXT NOT NULL, cost_usd DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (team_id, period));
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT NOT NULL, team_id TEXT NOT NULL, key_id TEXT NOT NULL,
    model_requested TEXT NOT NULL, model_used TEXT NOT NULL, tier TEXT NOT NULL,
    status TEXT NOT NULL, endpoint TEXT NOT NULL, prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL, cached_tokens BIGINT NOT NULL,
    cost_usd DOUBLE PRECISION NOT NULL,
    ttft_s DOUBLE PRECISION, latency_s DOUBLE PRECISION NOT NULL, nodes TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, "user" TEXT, migrations INTEGER, leg_tokens TEXT);
CREATE INDEX IF NOT EXISTS usage_team_time ON usage (team_id, created_at);
"""
#: tables later versions added (created when missing, like SCHEMA on an empty database)
GATEWAYS = (
    "CREATE TABLE IF NOT EXISTS gateways (id TEXT PRIMARY KEY, heartbeat_at DOUBLE PRECISION NOT "
    "NULL)"
)
#: the usage keys of usage records (base.Settlement.key, usage_keys.py)
USAGE_KEYS = (
    "CREATE TABLE IF NOT EXISTS usage_keys (request_id TEXT PRIMARY KEY, team_id TEXT NOT NULL, "
    "cost_usd DOUBLE PRECISION NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
    "billed_at DOUBLE PRECISION NOT NULL)"
)
#: the index the usage keys' prune reads (usage_keys.PRUNE_SQL)
USAGE_KEYS_BILLED = "CREATE INDEX IF NOT EXISTS usage_keys_billed ON usage_keys (billed_at)"
#: columns later versions added to existing tables: (table, column, type)
ADDED_COLUMNS = [
    ("usage", "user", "TEXT"),
    ("reservations", "gateway_id", "TEXT"),
    ("reservations", "booked", "TEXT"),
    ("usage", "migrations", "INTEGER"),
    ("usage", "leg_tokens", "TEXT"),
    ("reservations", "streamed_tokens", "BIGINT NOT NULL DEFAULT 0"),
    ("usage", "queue_s", "DOUBLE PRECISION"),
    ("usage", "adapter", "TEXT"),
    ("usage", "version", "TEXT"),
    ("usage", "cache_write_tokens", "BIGINT"),
    ("teams", "weight", "DOUBLE PRECISION"),
]

KEY_COLS = "id, team_id, name, prefix, created_at, revoked_at"
DAY_SQL = "to_char(to_timestamp(created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def team_of(r: Any) -> Team:
    return Team(
        id=r["id"],
        rpm=r["rpm"],
        tpm=r["tpm"],
        max_concurrent=r["max_concurrent"],
        daily_budget_usd=r["daily_budget_usd"],
        monthly_budget_usd=r["monthly_budget_usd"],
        default_tier=r["default_tier"],
        created_at=r["created_at"],
        weight=r["weight"],
    )


async def bucket(con: Any, team_id: str, second: int, requests: int, tokens: int) -> None:
    await con.execute(
        "INSERT INTO rate_buckets (team_id, second, requests, tokens) VALUES ($1,$2,$3,$4) "
        "ON CONFLICT (team_id, second) DO UPDATE SET requests = rate_buckets.requests + "
        "excluded.requests, tokens = rate_buckets.tokens + excluded.tokens",
        team_id,
        second,
        requests,
        tokens,
    )


async def unbook(con: Any, rid: str, team_id: str, cost: float) -> None:
    await con.execute(
        "UPDATE team_state SET active = active - 1, active_cost_usd = CASE WHEN active <= 1 THEN 0 "
        "ELSE active_cost_usd - $1 END WHERE team_id=$2",
        cost,
        team_id,
    )
    await con.execute("DELETE FROM reservations WHERE id=$1", rid)


async def expire_where(con: Any, now: float, where: str, *args: Any) -> int:
    """Bookings whose gateway never settled them stop counting; each bills its booked prompt and
    the tokens it had streamed as of its gateway's last heartbeat (an `expired` usage record,
    the day's and month's spend)."""
    rows = await con.fetch(
        f"SELECT id, team_id, key_id, request_id, created_at, tokens, cost_usd, booked, "
        f"streamed_tokens FROM reservations WHERE {where} FOR UPDATE",
        *args,
    )
    for r in rows:
        await unbook(con, r["id"], r["team_id"], r["cost_usd"])
        b = booked_from(r["booked"])
        record = expired_record(
            r["team_id"], r["key_id"], r["request_id"], b, now, r["streamed_tokens"]
        )
        # the window keeps what was billed, as a settled request's does (prompt + completion)
        billed = record.prompt_tokens + record.completion_tokens if record else 0
        await bucket(con, r["team_id"], int(r["created_at"]), 0, billed - r["tokens"])
        if record is not None:
            # keyed by its request id, always: if the request still settles (its gateway was
            # alive after all), its real record replaces this one (usage_keys.py)
            await write_usage(con, [(record, UsageKey.RERUN)], now)
    return len(rows)


async def settle_booking(con: Any, s: Settlement, now: float) -> Booking:
    """The booking's worst case becomes the request's real tokens, in the second it was booked."""
    row, r = None, s.record
    if s.reservation_id is not None:
        row = await con.fetchrow(
            "SELECT team_id, created_at, tokens, cost_usd FROM reservations WHERE id=$1 FOR UPDATE",
            s.reservation_id,
        )
        # the record's own (team, time, id): on the usage index, and a retry carries the same
        if row is None and await con.fetchval(
            "SELECT 1 FROM usage WHERE team_id=$1 AND created_at=$2 AND request_id=$3",
            r.team_id,
            r.created_at,
            r.request_id,
        ):
            return Booking.RECORDED
    if row is None or s.reservation_id is None:  # nothing booked, or it expired meanwhile:
        # the real tokens count from now (no reservation id, no row: the two tests agree)
        if s.tokens:
            await bucket(con, r.team_id, int(now), 0, s.tokens)
        return Booking.SETTLED if s.reservation_id is None else Booking.GONE
    await unbook(con, s.reservation_id, row["team_id"], row["cost_usd"])
    await bucket(con, row["team_id"], int(row["created_at"]), 0, s.tokens - row["tokens"])
    return Booking.SETTLED


async def add_columns(con: Any) -> None:
    """Bring a database an older version created up to `SCHEMA` (which runs only on an empty one).

    ALTER TABLE takes an ACCESS EXCLUSIVE lock even when IF NOT EXISTS finds the column, so,
    like the DDL above, it runs only when the column is really missing: once per database."""
    for table, column, type_ in ADDED_COLUMNS:
        if not await con.fetchval(
            "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = "
            "current_schema() AND table_name = $1 AND column_name = $2)",
            table,
            column,
        ):
            await con.execute(f'ALTER TABLE {table} ADD COLUMN IF NOT EXISTS "{column}" {type_}')


def key_of(r: Any) -> ApiKey:
    return ApiKey(
        id=r["id"],
        team_id=r["team_id"],
        name=r["name"],
        prefix=r["prefix"],
        created_at=r["created_at"],
        revoked_at=r["revoked_at"],
    )


async def reserve_in(con: Any, req: ReserveRequest) -> Reservation | Refusal:
    """The reservation's transaction (the caller's): the team's row locked (`FOR UPDATE`), so
    every gateway's reservations for a team are serialized by the database."""
    now = req.now
    r = await con.fetchrow(f"SELECT {TEAM_COLS} FROM teams WHERE id=$1 FOR UPDATE", req.team_id)
    if r is None:
        raise StoreError(403, f"team {req.team_id!r} no longer exists")
    team = team_of(r)
    await expire_where(con, now, "team_id=$1 AND expires_at<=$2", team.id, now)
    st = await con.fetchrow(
        "SELECT active, active_cost_usd FROM team_state WHERE team_id=$1", team.id
    )
    buckets = await con.fetch(
        "SELECT second, requests, tokens FROM rate_buckets WHERE team_id=$1 AND "
        "second>=$2 ORDER BY second",
        team.id,
        window_start(now),
    )
    spent = {
        row["period"]: row["cost_usd"]
        for row in await con.fetch(
            "SELECT period, cost_usd FROM spend WHERE team_id=$1 AND period = ANY($2::text[])",
            team.id,
            [day_period(now), month_period(now)],
        )
    }
    c = Counters(
        active=st["active"] if st else 0,
        active_cost=st["active_cost_usd"] if st else 0.0,
        window_requests=sum(b["requests"] for b in buckets),
        window_tokens=sum(b["tokens"] for b in buckets),
        window_oldest=float(buckets[0]["second"] + 1) if buckets else None,
        spent_day=spent.get(day_period(now), 0.0),
        spent_month=spent.get(month_period(now), 0.0),
    )
    verdict = decide(team, c, req, [(float(b["second"] + 1), b["tokens"]) for b in buckets])
    if isinstance(verdict, Refusal):
        return verdict
    rid = f"rsv-{secrets.token_hex(16)}"
    await con.execute(
        "INSERT INTO reservations (id, team_id, key_id, request_id, created_at, expires_at, "
        "tokens, cost_usd, gateway_id, booked) VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10)",
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
    )
    await con.execute(
        "INSERT INTO team_state (team_id, active, active_cost_usd) VALUES ($1, 1, $2) ON CONFLICT "
        "(team_id) DO UPDATE SET active = team_state.active + 1, active_cost_usd = "
        "team_state.active_cost_usd + excluded.active_cost_usd",
        team.id,
        req.cost_usd,
    )
    await bucket(con, team.id, int(now), 1, req.tokens)
    return Reservation(rid, verdict)
