"""PostgreSQL store (asyncpg), for several gateways sharing teams, keys, quotas and usage.

A reservation is one transaction that locks the team's row (`SELECT … FOR UPDATE`), so every
gateway's reservations for a team are serialized by the database and a limit holds across
processes and machines. In-flight and window counters are running totals (team_state,
rate_buckets), updated in the same transactions as the bookings. Counters are read in the
order in-flight → window → spend, so a settlement committing in between is counted twice
(conservative), never missed. Settlement batches take row locks in team order, so two
gateways' batches cannot deadlock.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import asyncpg

from gateway.accounts.store.base import (
    WINDOW_S,
    ApiKey,
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    StoreError,
    Team,
    UsageRecord,
)
from gateway.accounts.store.expiry import EXPIRED, booked_from, booked_json, expired_record
from gateway.accounts.store.rules import Counters, day_period, decide, month_period, window_start
from gateway.accounts.store.usage_totals import outliers_sql, totals_row, totals_sql

SCHEMA = """
CREATE TABLE IF NOT EXISTS teams (
    id TEXT PRIMARY KEY, rpm BIGINT, tpm BIGINT, max_concurrent BIGINT,
    daily_budget_usd DOUBLE PRECISION, monthly_budget_usd DOUBLE PRECISION, default_tier TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, name TEXT NOT NULL, prefix TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE, created_at DOUBLE PRECISION NOT NULL, revoked_at DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, key_id TEXT NOT NULL, request_id TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, expires_at DOUBLE PRECISION NOT NULL, tokens BIGINT NOT NULL,
    cost_usd DOUBLE PRECISION NOT NULL, gateway_id TEXT, booked TEXT, streamed_tokens BIGINT NOT NULL DEFAULT 0);
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
    completion_tokens BIGINT NOT NULL, cached_tokens BIGINT NOT NULL, cost_usd DOUBLE PRECISION NOT NULL,
    ttft_s DOUBLE PRECISION, latency_s DOUBLE PRECISION NOT NULL, nodes TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL, "user" TEXT, migrations INTEGER, leg_tokens TEXT);
CREATE INDEX IF NOT EXISTS usage_team_time ON usage (team_id, created_at);
"""
#: tables later versions added (created when missing, like SCHEMA on an empty database)
GATEWAYS = "CREATE TABLE IF NOT EXISTS gateways (id TEXT PRIMARY KEY, heartbeat_at DOUBLE PRECISION NOT NULL)"
#: the idempotency keys of usage records (base.UsageRecord.idempotent)
USAGE_KEYS = (
    "CREATE TABLE IF NOT EXISTS usage_keys (request_id TEXT PRIMARY KEY, team_id TEXT NOT NULL, "
    "cost_usd DOUBLE PRECISION NOT NULL, created_at DOUBLE PRECISION NOT NULL, "
    "billed_at DOUBLE PRECISION NOT NULL)"
)
#: columns later versions added to existing tables: (table, column, type)
ADDED_COLUMNS = [
    ("usage", "user", "TEXT"),
    ("reservations", "gateway_id", "TEXT"),
    ("reservations", "booked", "TEXT"),
    ("usage", "migrations", "INTEGER"),
    ("usage", "leg_tokens", "TEXT"),
    ("reservations", "streamed_tokens", "BIGINT NOT NULL DEFAULT 0"),
]

_TEAM_COLS = (
    "id, rpm, tpm, max_concurrent, daily_budget_usd, monthly_budget_usd, default_tier, created_at"
)
_KEY_COLS = "id, team_id, name, prefix, created_at, revoked_at"
_USAGE_COLS = (
    "request_id",
    "team_id",
    "key_id",
    "model_requested",
    "model_used",
    "tier",
    "status",
    "endpoint",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_usd",
    "ttft_s",
    "latency_s",
    "nodes",
    "created_at",
    "user",
    "migrations",
    "leg_tokens",
)
#: list columns stored as JSON text
_JSON_COLS = ("nodes", "leg_tokens")
# quoted: `user` is a reserved word in PostgreSQL (unquoted it means CURRENT_USER)
_USAGE_SQL = ", ".join(f'"{c}"' for c in _USAGE_COLS)
_DAY = "to_char(to_timestamp(created_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"


def _usage_record(r: Any) -> UsageRecord:
    return UsageRecord(
        **{
            **dict(r),
            "nodes": json.loads(r["nodes"]),
            "migrations": r["migrations"] or 0,
            "leg_tokens": json.loads(r["leg_tokens"] or "[]"),
        }
    )


def _team(r: Any) -> Team:
    return Team(
        id=r["id"],
        rpm=r["rpm"],
        tpm=r["tpm"],
        max_concurrent=r["max_concurrent"],
        daily_budget_usd=r["daily_budget_usd"],
        monthly_budget_usd=r["monthly_budget_usd"],
        default_tier=r["default_tier"],
        created_at=r["created_at"],
    )


async def _bucket(con: Any, team_id: str, second: int, requests: int, tokens: int) -> None:
    await con.execute(
        "INSERT INTO rate_buckets (team_id, second, requests, tokens) VALUES ($1,$2,$3,$4) ON CONFLICT "
        "(team_id, second) DO UPDATE SET requests = rate_buckets.requests + excluded.requests, "
        "tokens = rate_buckets.tokens + excluded.tokens",
        team_id,
        second,
        requests,
        tokens,
    )


async def _unbook(con: Any, rid: str, team_id: str, cost: float) -> None:
    await con.execute(
        "UPDATE team_state SET active = active - 1, active_cost_usd = CASE WHEN active <= 1 THEN 0 "
        "ELSE active_cost_usd - $1 END WHERE team_id=$2",
        cost,
        team_id,
    )
    await con.execute("DELETE FROM reservations WHERE id=$1", rid)


async def _expire(con: Any, now: float, where: str, *args: Any) -> int:
    """Bookings whose gateway never settled them stop counting; each bills its booked prompt and
    the tokens it had streamed as of its gateway's last heartbeat (an `expired` usage record,
    the day's and month's spend)."""
    rows = await con.fetch(
        f"SELECT id, team_id, key_id, request_id, created_at, tokens, cost_usd, booked, "
        f"streamed_tokens FROM reservations WHERE {where} FOR UPDATE",
        *args,
    )
    for r in rows:
        await _unbook(con, r["id"], r["team_id"], r["cost_usd"])
        b = booked_from(r["booked"])
        record = expired_record(
            r["team_id"], r["key_id"], r["request_id"], b, now, r["streamed_tokens"]
        )
        # the window keeps what was billed, as a settled request's does (prompt + completion)
        billed = record.prompt_tokens + record.completion_tokens if record else 0
        await _bucket(con, r["team_id"], int(r["created_at"]), 0, billed - r["tokens"])
        if record is not None and b is not None:
            await _write_usage(con, [(record, b.idempotent)], now)
    return len(rows)


async def _take_key(con: Any, r: UsageRecord, now: float) -> bool:
    """`r`'s key is billed once (base.Settlement.idempotent): True to write `r` — its key is
    new, or `r` replaces the key's earlier record (that record and its spend are taken back
    here). The key's row lock orders two gateways settling one key: the second waits for the
    first's commit, then replaces its record."""
    if await con.fetchval(
        "INSERT INTO usage_keys (request_id, team_id, cost_usd, created_at, billed_at) "
        "VALUES ($1,$2,$3,$4,$5) ON CONFLICT (request_id) DO NOTHING RETURNING 1",
        r.request_id,
        r.team_id,
        r.cost_usd,
        r.created_at,
        now,
    ):
        return True
    if r.status == EXPIRED:  # a dead run's booking: the key is billed already
        return False
    old = await con.fetchrow(
        "SELECT team_id, cost_usd, created_at, billed_at FROM usage_keys WHERE request_id=$1 "
        "FOR UPDATE",
        r.request_id,
    )
    # (team_id, created_at) is the usage table's index: no scan for the old record
    await con.execute(
        "DELETE FROM usage WHERE team_id=$1 AND created_at=$2 AND request_id=$3",
        old["team_id"],
        old["created_at"],
        r.request_id,
    )
    if old["cost_usd"] > 0:
        await con.execute(
            "UPDATE spend SET cost_usd = cost_usd - $1 WHERE team_id=$2 AND period = ANY($3::text[])",
            old["cost_usd"],
            old["team_id"],
            [day_period(old["billed_at"]), month_period(old["billed_at"])],
        )
    await con.execute(
        "UPDATE usage_keys SET team_id=$2, cost_usd=$3, created_at=$4, billed_at=$5 WHERE request_id=$1",
        r.request_id,
        r.team_id,
        r.cost_usd,
        r.created_at,
        now,
    )
    return True


async def _write_usage(con: Any, keyed: list[tuple[UsageRecord, bool]], now: float) -> None:
    """Write each record; one flagged `True` has an idempotency key (base.Settlement.idempotent)
    and is written at once after its key is taken, so a second record of the same key in this
    batch finds — and replaces — the first."""
    plain = [r for r, once in keyed if not once]
    for r, once in keyed:
        if once and await _take_key(con, r, now):
            await _insert_usage(con, [r], now)
    if plain:
        await _insert_usage(con, plain, now)


async def _insert_usage(con: Any, records: list[UsageRecord], now: float) -> None:
    for r in records:
        if r.cost_usd > 0:
            for period in (day_period(now), month_period(now)):
                await con.execute(
                    "INSERT INTO spend (team_id, period, cost_usd) VALUES ($1,$2,$3) "
                    "ON CONFLICT (team_id, period) DO UPDATE SET cost_usd = spend.cost_usd + "
                    "excluded.cost_usd",
                    r.team_id,
                    period,
                    r.cost_usd,
                )
    await con.executemany(
        f"INSERT INTO usage ({_USAGE_SQL}) VALUES ({', '.join(f'${i + 1}' for i in range(len(_USAGE_COLS)))})",
        [
            [json.dumps(getattr(r, c)) if c in _JSON_COLS else getattr(r, c) for c in _USAGE_COLS]
            for r in records
        ],
    )


async def _settle_booking(con: Any, s: Settlement, now: float) -> None:
    row = None
    if s.reservation_id is not None:
        row = await con.fetchrow(
            "SELECT team_id, created_at, tokens, cost_usd FROM reservations WHERE id=$1 FOR UPDATE",
            s.reservation_id,
        )
    if row is None:  # nothing booked, or it expired meanwhile: the real tokens count from now
        if s.tokens:
            await _bucket(con, s.record.team_id, int(now), 0, s.tokens)
        return
    await _unbook(con, s.reservation_id, row["team_id"], row["cost_usd"])  # type: ignore[arg-type]
    await _bucket(con, row["team_id"], int(row["created_at"]), 0, s.tokens - row["tokens"])


async def _add_columns(con: Any) -> None:
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


def _key(r: Any) -> ApiKey:
    return ApiKey(
        id=r["id"],
        team_id=r["team_id"],
        name=r["name"],
        prefix=r["prefix"],
        created_at=r["created_at"],
        revoked_at=r["revoked_at"],
    )


class PostgresStore(Store):
    def __init__(self, dsn: str, max_connections: int = 10) -> None:
        self.dsn = dsn
        self.max_connections = max_connections
        self._pool: asyncpg.Pool | None = None

    @property
    def pool(self) -> asyncpg.Pool:
        assert self._pool is not None, "store not open"
        return self._pool

    async def open(self) -> None:
        self._pool = await asyncpg.create_pool(self.dsn, min_size=1, max_size=self.max_connections)
        # Several gateways may start at once: one creates the schema, the others wait.
        async with self.pool.acquire() as con, con.transaction():
            await con.execute("SELECT pg_advisory_xact_lock(7477298)")
            # DDL only when missing: CREATE INDEX IF NOT EXISTS takes a SHARE lock on its table
            # even when the index exists, which deadlocks against a running gateway's writes.
            if await con.fetchval("SELECT to_regclass('usage_team_time')") is None:
                await con.execute(SCHEMA)
            if await con.fetchval("SELECT to_regclass('gateways')") is None:
                await con.execute(GATEWAYS)
            if await con.fetchval("SELECT to_regclass('usage_keys')") is None:
                await con.execute(USAGE_KEYS)
            await _add_columns(con)

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def create_team(self, team: Team) -> Team:
        t = (
            Team(**{f: getattr(team, f) for f in team.__struct_fields__})
            if team.created_at
            else Team(
                **{
                    **{f: getattr(team, f) for f in team.__struct_fields__},
                    "created_at": time.time(),
                }
            )
        )
        try:
            await self.pool.execute(
                f"INSERT INTO teams ({_TEAM_COLS}) VALUES ($1,$2,$3,$4,$5,$6,$7,$8)",
                t.id,
                t.rpm,
                t.tpm,
                t.max_concurrent,
                t.daily_budget_usd,
                t.monthly_budget_usd,
                t.default_tier,
                t.created_at,
            )
        except asyncpg.UniqueViolationError:
            raise StoreError(409, f"team {t.id!r} already exists") from None
        return t

    async def update_team(self, team: Team) -> Team | None:
        r = await self.pool.fetchrow(
            f"UPDATE teams SET rpm=$2, tpm=$3, max_concurrent=$4, daily_budget_usd=$5, monthly_budget_usd=$6, "
            f"default_tier=$7 WHERE id=$1 RETURNING {_TEAM_COLS}",
            team.id,
            team.rpm,
            team.tpm,
            team.max_concurrent,
            team.daily_budget_usd,
            team.monthly_budget_usd,
            team.default_tier,
        )
        return _team(r) if r else None

    async def get_team(self, team_id: str) -> Team | None:
        r = await self.pool.fetchrow(f"SELECT {_TEAM_COLS} FROM teams WHERE id=$1", team_id)
        return _team(r) if r else None

    async def list_teams(self) -> list[Team]:
        return [
            _team(r) for r in await self.pool.fetch(f"SELECT {_TEAM_COLS} FROM teams ORDER BY id")
        ]

    async def delete_team(self, team_id: str) -> bool:
        async with self.pool.acquire() as con, con.transaction():
            n = await con.execute("DELETE FROM teams WHERE id=$1", team_id)
            for table in ("team_state", "rate_buckets", "reservations"):
                await con.execute(f"DELETE FROM {table} WHERE team_id=$1", team_id)
            await con.execute(
                "UPDATE api_keys SET revoked_at=$1 WHERE team_id=$2 AND revoked_at IS NULL",
                time.time(),
                team_id,
            )
        return n != "DELETE 0"

    async def create_key(self, key: ApiKey, secret_hash: str) -> ApiKey:
        async with self.pool.acquire() as con, con.transaction():
            if await con.fetchval("SELECT 1 FROM teams WHERE id=$1", key.team_id) is None:
                raise StoreError(404, f"no team {key.team_id!r}")
            await con.execute(
                f"INSERT INTO api_keys ({_KEY_COLS}, secret_hash) VALUES ($1,$2,$3,$4,$5,$6,$7)",
                key.id,
                key.team_id,
                key.name,
                key.prefix,
                key.created_at,
                None,
                secret_hash,
            )
        return key

    async def key_by_hash(self, secret_hash: str) -> tuple[ApiKey, Team] | None:
        r = await self.pool.fetchrow(
            "SELECT k.id AS kid, k.team_id, k.name, k.prefix, k.created_at AS kcreated, k.revoked_at, t.* "
            "FROM api_keys k JOIN teams t ON t.id = k.team_id WHERE k.secret_hash=$1 AND k.revoked_at IS NULL",
            secret_hash,
        )
        if r is None:
            return None
        key = ApiKey(
            id=r["kid"],
            team_id=r["team_id"],
            name=r["name"],
            prefix=r["prefix"],
            created_at=r["kcreated"],
            revoked_at=r["revoked_at"],
        )
        return key, _team(r)

    async def list_keys(self, team_id: str | None = None) -> list[ApiKey]:
        if team_id:
            rows = await self.pool.fetch(
                f"SELECT {_KEY_COLS} FROM api_keys WHERE team_id=$1 ORDER BY created_at", team_id
            )
        else:
            rows = await self.pool.fetch(f"SELECT {_KEY_COLS} FROM api_keys ORDER BY created_at")
        return [_key(r) for r in rows]

    async def revoke_key(self, key_id: str) -> bool:
        n = await self.pool.execute(
            "UPDATE api_keys SET revoked_at=$1 WHERE id=$2 AND revoked_at IS NULL",
            time.time(),
            key_id,
        )
        return n != "UPDATE 0"

    async def reserve(self, req: ReserveRequest) -> Reservation | Refusal:
        now = req.now
        async with self.pool.acquire() as con, con.transaction():
            r = await con.fetchrow(
                f"SELECT {_TEAM_COLS} FROM teams WHERE id=$1 FOR UPDATE", req.team_id
            )
            if r is None:
                raise StoreError(403, f"team {req.team_id!r} no longer exists")
            team = _team(r)
            await _expire(con, now, "team_id=$1 AND expires_at<=$2", team.id, now)
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
            rid = f"rsv-{uuid.uuid4().hex}"
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
            await _bucket(con, team.id, int(now), 1, req.tokens)
            return Reservation(rid, verdict)

    async def settle(self, batch: list[Settlement]) -> None:
        now = time.time()
        batch = sorted(
            batch, key=lambda s: (s.record.team_id, s.record.request_id)
        )  # one lock order for every gateway
        async with self.pool.acquire() as con, con.transaction():
            for s in batch:
                await _settle_booking(con, s, now)
            await _write_usage(con, [(s.record, s.idempotent) for s in batch], now)

    async def expire_reservations(self, now: float | None = None) -> int:
        t = time.time() if now is None else now
        async with self.pool.acquire() as con, con.transaction():
            n = await _expire(con, t, "expires_at<=$1", t)
            await con.execute("DELETE FROM rate_buckets WHERE second < $1", int(t - 2 * WINDOW_S))
        return n

    async def heartbeat(
        self,
        gateway_id: str,
        ttl_s: float,
        now: float | None = None,
        streamed: Mapping[str, int] | None = None,
    ) -> None:
        t = time.time() if now is None else now
        ids, counts = list((streamed or {}).keys()), list((streamed or {}).values())
        async with self.pool.acquire() as con, con.transaction():
            await con.execute(
                "INSERT INTO gateways (id, heartbeat_at) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE "
                "SET heartbeat_at = excluded.heartbeat_at",
                gateway_id,
                t,
            )
            await con.execute(
                "UPDATE reservations SET expires_at = $1 WHERE gateway_id = $2 AND expires_at < $1",
                t + ttl_s,
                gateway_id,
            )
            if (
                ids
            ):  # one statement for all of them; GREATEST: a late report never lowers an earlier one
                await con.execute(
                    "UPDATE reservations AS r SET streamed_tokens = GREATEST(r.streamed_tokens, s.n) "
                    "FROM unnest($1::text[], $2::bigint[]) AS s(id, n) "
                    "WHERE r.id = s.id AND r.gateway_id = $3",
                    ids,
                    counts,
                    gateway_id,
                )

    async def reclaim(self, dead_after_s: float, now: float | None = None) -> int:
        t = time.time() if now is None else now
        async with self.pool.acquire() as con, con.transaction():
            dead = [
                r["id"]
                for r in await con.fetch(
                    "DELETE FROM gateways WHERE heartbeat_at < $1 RETURNING id", t - dead_after_s
                )
            ]
            n = 0
            for g in dead:
                n += await _expire(con, t, "gateway_id = $1", g)
            return n

    async def reclaim_previous(
        self, instance: str, gateway_id: str, now: float | None = None
    ) -> int:
        t = time.time() if now is None else now
        prefix = instance + "/"
        async with self.pool.acquire() as con, con.transaction():
            # left(), not LIKE: an instance name's '_' would be a wildcard
            await con.execute(
                "DELETE FROM gateways WHERE left(id, $1) = $2 AND id != $3",
                len(prefix),
                prefix,
                gateway_id,
            )
            return await _expire(
                con,
                t,
                "left(gateway_id, $1) = $2 AND gateway_id != $3",
                len(prefix),
                prefix,
                gateway_id,
            )

    async def leave(self, gateway_id: str) -> None:
        await self.pool.execute("DELETE FROM gateways WHERE id = $1", gateway_id)

    async def usage(
        self, team_id: str | None, start: float, end: float, group_by: str | None
    ) -> list[dict[str, Any]]:
        keys = {
            None: [],
            "model": [("model_requested", "model")],
            "day": [(_DAY, "date")],
            "team": [("team_id", "team_id")],
            "tier": [("tier", "tier")],
            "user": [('"user"', "user")],
        }[group_by]
        args: list[Any] = [start, end]
        where = "created_at >= $1 AND created_at < $2"
        if team_id:
            where += " AND team_id = $3"
            args.append(team_id)
        # NULLS FIRST: as SQLite orders them (PostgreSQL's default puts them last)
        rows = await self.pool.fetch(totals_sql(keys, where, "LEAST", " NULLS FIRST"), *args)
        return [totals_row([name for _, name in keys], r) for r in rows]

    async def usage_records(
        self,
        team_id: str | None,
        start: float,
        end: float,
        after: tuple[float, str] | None = None,
        limit: int | None = None,
    ) -> list[UsageRecord]:
        args: list[Any] = [start, end]
        where = "created_at >= $1 AND created_at < $2"
        if team_id:
            args.append(team_id)
            where += f" AND team_id = ${len(args)}"
        if after is not None:
            args += [after[0], after[1]]
            n = len(args)
            where += (
                f" AND (created_at > ${n - 1} OR (created_at = ${n - 1} AND request_id > ${n}))"
            )
        sql = f"SELECT {_USAGE_SQL} FROM usage WHERE {where} ORDER BY created_at, request_id"
        if limit is not None:
            args.append(limit)
            sql += f" LIMIT ${len(args)}"
        rows = await self.pool.fetch(sql, *args)
        return [_usage_record(r) for r in rows]

    async def usage_outliers(
        self, team_id: str | None, start: float, end: float, limit: int
    ) -> list[UsageRecord]:
        args: list[Any] = [start, end, limit]
        where = "created_at >= $1 AND created_at < $2"
        if team_id:
            where += " AND team_id = $4"
            args.append(team_id)
        cols = ", ".join(f'usage."{c}"' for c in _USAGE_COLS)
        rows = await self.pool.fetch(outliers_sql(cols, where, "LEAST", "$3"), *args)
        return [_usage_record(r) for r in rows]
