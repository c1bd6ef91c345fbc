"""PostgreSQL store (asyncpg), for several gateways sharing teams, keys, quotas and usage.

A reservation is one transaction that locks the team's row (`SELECT … FOR UPDATE`), so every
gateway's reservations for a team are serialized by the database and a limit holds across
processes and machines. In-flight and window counters are running totals (team_state,
rate_buckets), updated in the same transactions as the bookings. Counters are read in the
order in-flight → window → spend, so a settlement committing in between is counted twice
(conservative), never missed. Settlement batches take row locks in team order, so two
gateways' batches cannot deadlock.

Three pools: the main one (bookings, settlements, teams, the batch tables), the heartbeat's one
connection (a heartbeat waiting for a busy pool would make this gateway look dead), and the
usage reports' read-only pool of REPORT_CONNECTIONS (a report over many rows waits for its own
kind, never holds a connection that bookings need).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

import asyncpg

from gateway.accounts.store.base import (
    USAGE_COLS,
    WINDOW_S,
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    UsageRecord,
)
from gateway.accounts.store.expiry import Booking
from gateway.accounts.store.postgres_batch import PostgresBatchTables, create_batch_tables
from gateway.accounts.store.postgres_quota import (
    DAY_SQL,
    GATEWAYS,
    SCHEMA,
    USAGE_KEYS,
    USAGE_KEYS_BILLED,
    add_columns,
    expire_where,
    reserve_in,
    settle_booking,
)
from gateway.accounts.store.postgres_teams import PostgresTeams
from gateway.accounts.store.postgres_usage import USAGE_SQL, usage_record_of, write_usage
from gateway.accounts.store.team_ids import POSTGRES as TOMBSTONES
from gateway.accounts.store.usage_keys import mode_of
from gateway.accounts.store.usage_totals import group_keys, outliers_sql, totals_row, totals_sql


async def _clock(con: asyncpg.Connection, now: float | None) -> float:
    """`now`, or the database's clock as of this statement (not the transaction's start)."""
    if now is not None:
        return now
    return float(await con.fetchval("SELECT extract(epoch FROM clock_timestamp())::float8"))


#: the usage reports' own connections: a report over a large table waits for one of these, never
#: for a slot of the pool that books and settles every team's requests
REPORT_CONNECTIONS = 2


class PostgresStore(PostgresTeams, PostgresBatchTables, Store):
    """The one store on PostgreSQL: the accounts' tables and the batch tier's (pools: above)."""

    def __init__(self, dsn: str, max_connections: int = 16) -> None:
        self.dsn = dsn
        self.path = dsn.split("@")[-1].split("?")[0]  # for logs: no credentials
        self.max_connections = max_connections
        self._pool: asyncpg.Pool | None = None
        #: the heartbeat's own connection (and its reclaim and expiry): a heartbeat that waited
        #: for a slot of a busy pool makes this gateway look dead to every other gateway
        self._beats: asyncpg.Pool | None = None
        #: usage reports (`/v1/usage`, its records and outliers) on a small read-only pool of
        #: their own: on the main pool, a few slow reports at once held every connection and
        #: every reservation and settlement of every team waited behind them
        self._reports: asyncpg.Pool | None = None
        #: the batch tables are created at their first use (a gateway without a batch tier
        #: never makes them)
        self._batch_ready = False
        self._batch_lock = asyncio.Lock()

    async def _p(self) -> asyncpg.Pool:
        if not self._batch_ready:
            async with self._batch_lock:
                if not self._batch_ready:
                    await create_batch_tables(self.pool)
                    self._batch_ready = True
        return self.pool

    @property
    def _beat_pool(self) -> asyncpg.Pool:
        assert self._beats is not None, "store not open"
        return self._beats

    @property
    def _report_pool(self) -> asyncpg.Pool:
        assert self._reports is not None, "store not open"
        return self._reports

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
            if await con.fetchval("SELECT to_regclass('usage_keys_billed')") is None:
                await con.execute(USAGE_KEYS_BILLED)
            if await con.fetchval("SELECT to_regclass('team_tombstones')") is None:
                await con.execute(TOMBSTONES)
            await add_columns(con)
        self._beats = await asyncpg.create_pool(self.dsn, min_size=1, max_size=1)
        self._reports = await asyncpg.create_pool(
            self.dsn,
            min_size=0,
            max_size=REPORT_CONNECTIONS,
            server_settings={"default_transaction_read_only": "on"},
        )

    async def close(self) -> None:
        if self._reports is not None:
            await self._reports.close()
            self._reports = None
        if self._beats is not None:
            await self._beats.close()
            self._beats = None
        if self._pool is not None:
            await self._pool.close()
            self._pool = None

    async def reserve(self, req: ReserveRequest) -> Reservation | Refusal:
        async with self.pool.acquire() as con, con.transaction():
            return await reserve_in(con, req)

    async def settle(self, batch: list[Settlement]) -> None:
        now = time.time()
        batch = sorted(
            batch, key=lambda s: (s.record.team_id, s.record.request_id)
        )  # one lock order for every gateway
        async with self.pool.acquire() as con, con.transaction():
            # a booking gone before its settlement was billed `expired` under its request id:
            # the real record replaces that one (usage_keys.py), never joins it
            keyed = []
            for s in batch:
                b = await settle_booking(con, s, now)
                if b is not Booking.RECORDED:
                    keyed.append((s.record, mode_of(s.key, b is Booking.GONE)))
            await write_usage(con, keyed, now)

    async def expire_reservations(self, now: float | None = None) -> int:
        async with self._beat_pool.acquire() as con, con.transaction():
            t = await _clock(con, now)
            n = await expire_where(con, t, "expires_at<=$1", t)
            await con.execute("DELETE FROM rate_buckets WHERE second < $1", int(t - 2 * WINDOW_S))
        return n

    async def heartbeat(
        self,
        gateway_id: str,
        ttl_s: float,
        now: float | None = None,
        streamed: Mapping[str, int] | None = None,
    ) -> float | None:
        ids, counts = list((streamed or {}).keys()), list((streamed or {}).values())
        async with self._beat_pool.acquire() as con, con.transaction():
            prev = await con.fetchval(
                "SELECT heartbeat_at FROM gateways WHERE id = $1 FOR UPDATE", gateway_id
            )
            # the database's clock, read once the row is this transaction's: every gateway's
            # heartbeat and every reclaim compare one clock, and a call that waited for a lock
            # or a connection is not stale as it lands
            t = await _clock(con, now)
            await con.execute(
                "INSERT INTO gateways (id, heartbeat_at) VALUES ($1, $2) ON CONFLICT (id) DO "
                "UPDATE SET heartbeat_at = excluded.heartbeat_at",
                gateway_id,
                t,
            )
            await con.execute(
                "UPDATE reservations SET expires_at = $1 WHERE gateway_id = $2 AND expires_at < $1",
                t + ttl_s,
                gateway_id,
            )
            if ids:  # one statement for all; GREATEST: a late report never lowers an earlier one
                await con.execute(
                    "UPDATE reservations AS r SET streamed_tokens = GREATEST(r.streamed_tokens, "
                    "s.n) FROM unnest($1::text[], $2::bigint[]) AS s(id, n) WHERE r.id = s.id "
                    "AND r.gateway_id = $3",
                    ids,
                    counts,
                    gateway_id,
                )
        return None if prev is None else t - prev

    async def reclaim(
        self, dead_after_s: float, now: float | None = None, gateway_id: str | None = None
    ) -> int:
        async with self._beat_pool.acquire() as con, con.transaction():
            t = await _clock(con, now)
            dead = [
                r["id"]
                for r in await con.fetch(
                    "DELETE FROM gateways WHERE heartbeat_at < $1 AND id != $2 RETURNING id",
                    t - dead_after_s,
                    gateway_id or "",
                )
            ]
            n = 0
            for g in dead:
                n += await expire_where(con, t, "gateway_id = $1", g)
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
            return await expire_where(
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
        keys = group_keys(group_by, DAY_SQL, '"user"')
        args: list[Any] = [start, end]
        where = "created_at >= $1 AND created_at < $2"
        if team_id:
            where += " AND team_id = $3"
            args.append(team_id)
        # NULLS FIRST: as SQLite orders them (PostgreSQL's default puts them last)
        rows = await self._report_pool.fetch(
            totals_sql(keys, where, "LEAST", " NULLS FIRST"), *args
        )
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
        sql = f"SELECT {USAGE_SQL} FROM usage WHERE {where} ORDER BY created_at, request_id"
        if limit is not None:
            args.append(limit)
            sql += f" LIMIT ${len(args)}"
        rows = await self._report_pool.fetch(sql, *args)
        return [usage_record_of(r) for r in rows]

    async def usage_outliers(
        self, team_id: str | None, start: float, end: float, limit: int
    ) -> list[UsageRecord]:
        args: list[Any] = [start, end, limit]
        where = "created_at >= $1 AND created_at < $2"
        if team_id:
            where += " AND team_id = $4"
            args.append(team_id)
        cols = ", ".join(f'usage."{c}"' for c in USAGE_COLS)
        rows = await self._report_pool.fetch(outliers_sql(cols, where, "LEAST", "$3"), *args)
        return [usage_record_of(r) for r in rows]
