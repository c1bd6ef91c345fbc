"""The batch tier's tables on PostgreSQL (`BatchTables`, batch_tables.py), in the database of the
gateways' one store (the tables earlier versions used: batch_files, batches, batch_requests).

Same schema, states and invariants as the SQLite tables (sqlite_batch.py). Claims take their
rows with `FOR UPDATE ... SKIP LOCKED` inside one transaction, so runners on different machines
never claim the same request or finalize the same batch, and never wait for each other's
locks. `finish_request`/`retry_request` check the claim in the same statement, so a runner
whose lease was taken over cannot write a second result.

`PostgresBatchTables` is the part of the one `PostgresStore` (postgres.py) that serves them,
on its pool; `PostgresBatchStore` is that part alone, with a pool of its own (the batch tier's
tests). The tables are created at first use, under an advisory lock. The runner's half of the
methods is postgres_batch_claims.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import asyncpg

from gateway.accounts.store.batch_tables import OPEN, Conflict, TeamLimit
from gateway.accounts.store.postgres_batch_claims import (
    LIVE,
    PostgresBatchClaims,
    cursor_of,
    insert_file_row,
    lock_team,
    marks,
    open_batches,
    tag_count,
    team_bytes,
)
from gateway.batch import rows
from gateway.batch.rows import (
    BATCH_COLS,
    FILE_COLS,
    REQUEST_INSERT_COLS,
    BatchRow,
    FileRow,
    NewRequest,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS batch_files (
    seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL UNIQUE, team_id TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL, bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    deleted BOOLEAN NOT NULL DEFAULT FALSE, expires_at DOUBLE PRECISION);
ALTER TABLE batch_files ADD COLUMN IF NOT EXISTS expires_at DOUBLE PRECISION;
CREATE INDEX IF NOT EXISTS batch_files_team ON batch_files (team_id, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq BIGSERIAL PRIMARY KEY, id TEXT NOT NULL UNIQUE, team_id TEXT NOT NULL, kind TEXT NOT NULL,
    endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL,
    status TEXT NOT NULL, priority INTEGER NOT NULL DEFAULT 1, metadata TEXT, errors TEXT,
    total INTEGER NOT NULL DEFAULT 0, output_file_id TEXT, error_file_id TEXT,
    created_at DOUBLE PRECISION NOT NULL, in_progress_at DOUBLE PRECISION,
    expires_at DOUBLE PRECISION NOT NULL, finalizing_at DOUBLE PRECISION,
    completed_at DOUBLE PRECISION, failed_at DOUBLE PRECISION, expired_at DOUBLE PRECISION,
    cancelling_at DOUBLE PRECISION, cancelled_at DOUBLE PRECISION, claimed_by TEXT,
    lease_until DOUBLE PRECISION, callback_url TEXT, callback_state TEXT,
    callback_attempts INTEGER NOT NULL DEFAULT 0, callback_next_at DOUBLE PRECISION,
    callback_error TEXT,
    body_bytes BIGINT NOT NULL DEFAULT 0,
    n_succeeded INTEGER NOT NULL DEFAULT 0, n_failed INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS batches_team ON batches (team_id, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, line INTEGER NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending', attempts INTEGER NOT NULL DEFAULT 0,
    not_before DOUBLE PRECISION NOT NULL DEFAULT 0, claimed_by TEXT, lease_until DOUBLE PRECISION,
    started_at DOUBLE PRECISION, finished_at DOUBLE PRECISION, status_code INTEGER, request_id TEXT,
    response TEXT, error TEXT, PRIMARY KEY (batch_id, custom_id));
CREATE INDEX IF NOT EXISTS batch_requests_state ON batch_requests (state, not_before);
CREATE INDEX IF NOT EXISTS batch_requests_line ON batch_requests (batch_id, line);
"""
#: the requests by state and end: the throughput estimate every `POST /v1/batch` and simple
#: status poll makes (`mean_request_seconds`) reads the recent successes only, not every one
#: the tables ever held. Created on open when missing, so older databases gain it too.
FINISHED_INDEX = (
    "CREATE INDEX IF NOT EXISTS batch_requests_finished ON batch_requests (state, finished_at)"
)
#: the claim's per-batch reads (claim_order.py): a batch's lines by state in line order, and by
#: start. Created on open when missing, like FINISHED_INDEX.
CLAIM_INDEXES = {
    "batch_requests_claim": "CREATE INDEX IF NOT EXISTS batch_requests_claim ON batch_requests "
    "(batch_id, state, line)",
    "batch_requests_started": "CREATE INDEX IF NOT EXISTS batch_requests_started ON "
    "batch_requests (batch_id, started_at)",
}
_HAS_COLUMN = (
    "SELECT EXISTS (SELECT 1 FROM information_schema.columns WHERE table_name='batches' "
    "AND column_name=$1 AND table_schema=current_schema())"
)
#: serializes schema creation between gateways starting at once (CREATE IF NOT EXISTS races)
_SCHEMA_LOCK = 0x6475657462617463


async def create_batch_tables(pool: asyncpg.Pool) -> None:
    """The batch tables, when missing (several gateways may start at once: one creates them)."""
    async with pool.acquire() as con, con.transaction():
        await con.execute("SELECT pg_advisory_xact_lock($1)", _SCHEMA_LOCK)
        # DDL only when missing: CREATE INDEX IF NOT EXISTS still takes a SHARE lock on its
        # table, which deadlocks against another gateway's runner already writing to it (seen
        # with two gateways starting at once).
        if await con.fetchval("SELECT to_regclass('batch_requests_line')") is None:
            await con.execute(SCHEMA)
        # tables of an earlier version
        if not await con.fetchval(_HAS_COLUMN, "body_bytes"):
            await con.execute("ALTER TABLE batches ADD COLUMN body_bytes BIGINT NOT NULL DEFAULT 0")
        if not await con.fetchval(_HAS_COLUMN, "n_failed"):
            for c in rows.COUNT_COLS:
                await con.execute(f"ALTER TABLE batches ADD COLUMN {c} INTEGER NOT NULL DEFAULT 0")
            await con.execute(rows.BACKFILL_COUNTS)
            await con.execute(rows.DROP_ENDED_LINES)
        if await con.fetchval("SELECT to_regclass('batch_requests_finished')") is None:
            await con.execute(FINISHED_INDEX)
        for name, ddl in CLAIM_INDEXES.items():
            if await con.fetchval("SELECT to_regclass($1)", name) is None:
                await con.execute(ddl)


class PostgresBatchTables(PostgresBatchClaims):
    """`BatchTables` on the pool `_p()` gives (its tables created)."""

    async def insert_file(self, row: FileRow, max_team_bytes: int | None = None) -> None:
        async with (await self._p()).acquire() as con, con.transaction():
            if max_team_bytes is not None:
                await lock_team(con, row.team_id)  # held from this read to the commit
                held = await team_bytes(con, row.team_id)
                if held + row.bytes > max_team_bytes:
                    raise TeamLimit("bytes", held)
            await insert_file_row(con, row)

    async def get_file(self, team_id: str, file_id: str) -> FileRow | None:
        r = await (await self._p()).fetchrow(
            f"SELECT {FILE_COLS} FROM batch_files WHERE id=$1 AND team_id=$2 "
            f"AND NOT deleted AND {LIVE}",
            file_id,
            team_id,
            time.time(),
        )
        return FileRow(*r) if r else None

    async def list_files(
        self, team_id: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileRow], bool]:
        async with (await self._p()).acquire() as con:
            cursor = await cursor_of(con, "batch_files", team_id, after)
            found = await con.fetch(
                f"SELECT {FILE_COLS} FROM batch_files WHERE team_id=$1 AND NOT deleted "
                "AND seq<$2 AND ($3::text IS NULL OR purpose=$3) AND (expires_at IS NULL OR "
                "expires_at > $5) ORDER BY seq DESC LIMIT $4",
                team_id,
                cursor,
                purpose,
                limit + 1,
                time.time(),
            )
        return [FileRow(*r) for r in found[:limit]], len(found) > limit

    async def delete_file(self, team_id: str, file_id: str) -> bool:
        tag = await (await self._p()).execute(
            "UPDATE batch_files SET deleted=TRUE WHERE id=$1 AND team_id=$2 AND NOT deleted",
            file_id,
            team_id,
        )
        return tag_count(tag) == 1

    async def purge_expired_files(self, now: float, limit: int = 100) -> list[str]:
        rows = await (await self._p()).fetch(
            "UPDATE batch_files SET deleted=TRUE WHERE id IN (SELECT id FROM batch_files "
            "WHERE NOT deleted AND expires_at IS NOT NULL AND expires_at<=$1 LIMIT $2 FOR "
            "UPDATE SKIP LOCKED) RETURNING id",
            now,
            limit,
        )
        return [r["id"] for r in rows]

    async def create_batch(
        self,
        row: BatchRow,
        requests: Iterable[NewRequest],
        max_open: int | None = None,
        max_team_bytes: int | None = None,
    ) -> None:
        async with (await self._p()).acquire() as con, con.transaction():
            if (max_open is not None and row.status in OPEN) or max_team_bytes is not None:
                await lock_team(con, row.team_id)  # held from this read to the commit
            if max_open is not None and row.status in OPEN:
                held = await open_batches(con, row.team_id)
                if held >= max_open:
                    raise TeamLimit("open_batches", held)
            values = rows.RequestValues(row.id, requests)
            await con.copy_records_to_table(
                "batch_requests", columns=list(REQUEST_INSERT_COLS), records=values
            )
            if max_team_bytes is not None and values.body_bytes:
                held = await team_bytes(con, row.team_id)
                if held + values.body_bytes > max_team_bytes:
                    raise TeamLimit("bytes", held)
            await con.execute(rows.insert_batch_sql(marks), *rows.batch_values(row, values.count))
            await con.execute(
                "UPDATE batches SET body_bytes=$1 WHERE id=$2", values.body_bytes, row.id
            )
            if rows.callback_starts_at_creation(row):
                await con.execute(
                    "UPDATE batches SET callback_state='pending', callback_next_at=$1 WHERE id=$2",
                    row.created_at,
                    row.id,
                )

    async def get_batch(self, team_id: str | None, batch_id: str) -> BatchRow | None:
        async with (await self._p()).acquire() as con:
            r = await con.fetchrow(
                f"SELECT {BATCH_COLS} FROM batches WHERE id=$1 AND ($2::text IS NULL OR "
                "team_id=$2)",
                batch_id,
                team_id,
            )
            return rows.batch_row(r) if r else None

    async def list_batches(
        self, team_id: str, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        async with (await self._p()).acquire() as con:
            cursor = await cursor_of(con, "batches", team_id, after)
            found = await con.fetch(
                f"SELECT {BATCH_COLS} FROM batches WHERE team_id=$1 AND seq<$2 "
                "ORDER BY seq DESC LIMIT $3",
                team_id,
                cursor,
                limit + 1,
            )
            return [rows.batch_row(r) for r in found[:limit]], len(found) > limit

    async def cancel_batch(self, team_id: str, batch_id: str, now: float) -> BatchRow | None:
        async with (await self._p()).acquire() as con, con.transaction():
            status = await con.fetchval(
                "SELECT status FROM batches WHERE id=$1 AND team_id=$2 FOR UPDATE",
                batch_id,
                team_id,
            )
            if status is None:
                return None
            if status in ("validating", "in_progress"):
                await con.execute(
                    "UPDATE batches SET status='cancelling', cancelling_at=$1 WHERE id=$2",
                    now,
                    batch_id,
                )
                # Not-yet-started work is dropped now; running requests finish and are kept.
                await con.execute(
                    "UPDATE batch_requests SET state='cancelled' WHERE batch_id=$1 AND "
                    "state='pending'",
                    batch_id,
                )
            elif status != "cancelling":
                raise Conflict(f"a batch that is {status} cannot be cancelled")
            r = await con.fetchrow(f"SELECT {BATCH_COLS} FROM batches WHERE id=$1", batch_id)
            return rows.batch_row(r)

    async def team_holdings(self, team_id: str) -> tuple[int, int]:
        async with (await self._p()).acquire() as con:
            return await team_bytes(con, team_id), await open_batches(con, team_id)


class PostgresBatchStore(PostgresBatchTables):
    """The batch tables alone, on a pool of their own (opened at first use)."""

    def __init__(self, dsn: str, max_connections: int = 8) -> None:
        self.dsn = dsn
        self.path = dsn.split("@")[-1].split("?")[0]  # for logs: no credentials
        self.max_connections = max_connections
        self._pool: asyncpg.Pool | None = None
        self._opening = asyncio.Lock()

    async def _p(self) -> asyncpg.Pool:
        if self._pool is None:
            async with self._opening:
                if self._pool is None:
                    pool = await asyncpg.create_pool(
                        self.dsn, min_size=1, max_size=self.max_connections
                    )
                    await create_batch_tables(pool)
                    self._pool = pool
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
