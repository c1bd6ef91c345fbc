"""The batch tier's tables in SQLite (`BatchTables`, batch_tables.py), on their own file in the
batch data directory (`batch.sqlite3`, where earlier versions kept them: a gateway started on
an older data directory reads its files and batches as they are), through the same connection
class as the accounts' tables (sqlite_conn.py): one worker thread, and every write a
`BEGIN IMMEDIATE` transaction, so several gateway processes may share the file.

`SqliteBatchTables` is the part of the one `SqliteStore` (sqlite.py) that serves them;
`SqliteBatchStore` is that part alone (the batch tier's own tests, tools). The file is opened
on its first use: a gateway whose batch tier is off never creates it. The runner's half of the
methods (claims, leases, results, callbacks) is sqlite_batch_claims.py's.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from gateway.accounts.store.batch_tables import OPEN, Conflict, TeamLimit
from gateway.accounts.store.sqlite_batch_claims import (
    LIVE,
    SqliteBatchClaims,
    cursor_of,
    insert_file_row,
    marks,
    open_batches,
    team_bytes,
)
from gateway.accounts.store.sqlite_conn import Connections
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
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    team_id TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    deleted INTEGER NOT NULL DEFAULT 0,
    expires_at REAL
);
CREATE INDEX IF NOT EXISTS batch_files_team ON batch_files (team_id, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    team_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    priority INTEGER NOT NULL DEFAULT 1,
    metadata TEXT,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at REAL NOT NULL,
    in_progress_at REAL, expires_at REAL NOT NULL, finalizing_at REAL, completed_at REAL,
    failed_at REAL, expired_at REAL, cancelling_at REAL, cancelled_at REAL,
    claimed_by TEXT,
    lease_until REAL,
    callback_url TEXT,
    callback_state TEXT,
    callback_attempts INTEGER NOT NULL DEFAULT 0,
    callback_next_at REAL,
    callback_error TEXT,
    body_bytes INTEGER NOT NULL DEFAULT 0,
    n_succeeded INTEGER NOT NULL DEFAULT 0,
    n_failed INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_team ON batches (team_id, seq);
CREATE INDEX IF NOT EXISTS batches_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch_id TEXT NOT NULL,
    custom_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    body TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    not_before REAL NOT NULL DEFAULT 0,
    claimed_by TEXT,
    lease_until REAL,
    started_at REAL,
    finished_at REAL,
    status_code INTEGER,
    request_id TEXT,
    response TEXT,
    error TEXT,
    PRIMARY KEY (batch_id, custom_id)
);
CREATE INDEX IF NOT EXISTS batch_requests_state ON batch_requests (state, not_before);
CREATE INDEX IF NOT EXISTS batch_requests_line ON batch_requests (batch_id, line);
"""
#: the requests by state and end: the throughput estimate every `POST /v1/batch` and simple
#: status poll makes (`mean_request_seconds`) reads the recent successes only, not every one
#: the tables ever held. Created on open when missing, so older databases gain it too.
FINISHED_INDEX = (
    "CREATE INDEX IF NOT EXISTS batch_requests_finished ON batch_requests (state, finished_at)"
)
#: a batch's lines by state in line order (its next claimable lines: a range, not a walk over
#: its finished ones) and its lines by start (its latest start: one entry); the claim reads
#: both per open batch (claim_order.py). Created on open when missing, like FINISHED_INDEX.
CLAIM_INDEXES = (
    "CREATE INDEX IF NOT EXISTS batch_requests_claim ON batch_requests (batch_id, state, line)",
    "CREATE INDEX IF NOT EXISTS batch_requests_started ON batch_requests (batch_id, started_at)",
)


def init_batch_tables(db: sqlite3.Connection) -> None:
    """Create the tables (and bring an older file up to date: `expires_at`, `body_bytes` and
    the request counts came later)."""
    db.executescript(SCHEMA)
    db.execute(FINISHED_INDEX)
    for index in CLAIM_INDEXES:
        db.execute(index)
    if "expires_at" not in {r[1] for r in db.execute("PRAGMA table_info(batch_files)")}:
        db.execute("ALTER TABLE batch_files ADD COLUMN expires_at REAL")
    cols = {r[1] for r in db.execute("PRAGMA table_info(batches)")}
    if "body_bytes" not in cols:
        db.execute("ALTER TABLE batches ADD COLUMN body_bytes INTEGER NOT NULL DEFAULT 0")
    if not cols.issuperset(rows.COUNT_COLS):
        for c in rows.COUNT_COLS:
            db.execute(f"ALTER TABLE batches ADD COLUMN {c} INTEGER NOT NULL DEFAULT 0")
        db.execute(rows.BACKFILL_COUNTS)
        db.execute(rows.DROP_ENDED_LINES)


class SqliteBatchTables(SqliteBatchClaims):
    """`BatchTables` on `self._batch`, the batch file's connections."""

    _batch: Connections

    async def insert_file(self, row: FileRow, max_team_bytes: int | None = None) -> None:
        def q(db: sqlite3.Connection) -> None:
            # under BEGIN IMMEDIATE: the write lock is held from this read to the insert
            if max_team_bytes is not None:
                held = team_bytes(db, row.team_id)
                if held + row.bytes > max_team_bytes:
                    raise TeamLimit("bytes", held)
            insert_file_row(db, row)

        await self._batch.write(q)

    async def get_file(self, team_id: str, file_id: str) -> FileRow | None:
        def q(db: sqlite3.Connection) -> FileRow | None:
            r = db.execute(
                f"SELECT {FILE_COLS} FROM batch_files WHERE id=? AND team_id=? "
                f"AND deleted=0 AND {LIVE}",
                (file_id, team_id, time.time()),
            ).fetchone()
            return FileRow(*r) if r else None

        return await self._batch.read(q)

    async def list_files(
        self, team_id: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileRow], bool]:
        def q(db: sqlite3.Connection) -> tuple[list[FileRow], bool]:
            cursor = cursor_of(db, "batch_files", team_id, after)
            found = db.execute(
                f"SELECT {FILE_COLS} FROM batch_files WHERE team_id=? AND deleted=0 AND seq<? "
                f"AND (? IS NULL OR purpose=?) AND {LIVE} ORDER BY seq DESC LIMIT ?",
                (team_id, cursor, purpose, purpose, time.time(), limit + 1),
            ).fetchall()
            return [FileRow(*r) for r in found[:limit]], len(found) > limit

        return await self._batch.read(q)

    async def delete_file(self, team_id: str, file_id: str) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            return (
                db.execute(
                    "UPDATE batch_files SET deleted=1 WHERE id=? AND team_id=? AND deleted=0",
                    (file_id, team_id),
                ).rowcount
                == 1
            )

        return await self._batch.write(q)

    async def purge_expired_files(self, now: float, limit: int = 100) -> list[str]:
        def q(db: sqlite3.Connection) -> list[str]:
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT id FROM batch_files WHERE deleted=0 AND expires_at IS NOT NULL "
                    "AND expires_at<=? LIMIT ?",
                    (now, limit),
                )
            ]
            db.executemany("UPDATE batch_files SET deleted=1 WHERE id=?", [(i,) for i in ids])
            return ids

        return await self._batch.write(
            q
        )  # the write lock from the read on: two gateways never purge one file twice

    async def create_batch(
        self,
        row: BatchRow,
        requests: Iterable[NewRequest],
        max_open: int | None = None,
        max_team_bytes: int | None = None,
    ) -> None:
        def q(db: sqlite3.Connection) -> None:
            if max_open is not None and row.status in OPEN:  # under the write lock, like the insert
                held = open_batches(db, row.team_id)
                if held >= max_open:
                    raise TeamLimit("open_batches", held)
            values = rows.RequestValues(row.id, requests)
            db.executemany(
                f"INSERT INTO batch_requests ({', '.join(REQUEST_INSERT_COLS)}) VALUES (?,?,?,?)",
                values,
            )
            if max_team_bytes is not None and values.body_bytes:
                held = team_bytes(db, row.team_id)
                if held + values.body_bytes > max_team_bytes:
                    raise TeamLimit("bytes", held)
            db.execute(rows.insert_batch_sql(marks), rows.batch_values(row, values.count))
            db.execute("UPDATE batches SET body_bytes=? WHERE id=?", (values.body_bytes, row.id))
            if rows.callback_starts_at_creation(row):
                db.execute(
                    "UPDATE batches SET callback_state='pending', callback_next_at=? WHERE id=?",
                    (row.created_at, row.id),
                )

        await self._batch.write(q)

    async def get_batch(self, team_id: str | None, batch_id: str) -> BatchRow | None:
        def q(db: sqlite3.Connection) -> BatchRow | None:
            r = db.execute(
                f"SELECT {BATCH_COLS} FROM batches WHERE id=? AND (? IS NULL OR team_id=?)",
                (batch_id, team_id, team_id),
            ).fetchone()
            return rows.batch_row(r) if r else None

        return await self._batch.read(q)

    async def list_batches(
        self, team_id: str, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        def q(db: sqlite3.Connection) -> tuple[list[BatchRow], bool]:
            cursor = cursor_of(db, "batches", team_id, after)
            found = db.execute(
                f"SELECT {BATCH_COLS} FROM batches WHERE team_id=? AND seq<? "
                "ORDER BY seq DESC LIMIT ?",
                (team_id, cursor, limit + 1),
            ).fetchall()
            return [rows.batch_row(r) for r in found[:limit]], len(found) > limit

        return await self._batch.read(q)

    async def cancel_batch(self, team_id: str, batch_id: str, now: float) -> BatchRow | None:
        def q(db: sqlite3.Connection) -> BatchRow | None:
            r = db.execute(
                "SELECT status FROM batches WHERE id=? AND team_id=?", (batch_id, team_id)
            ).fetchone()
            if r is None:
                return None
            if r[0] in ("validating", "in_progress"):
                db.execute(
                    "UPDATE batches SET status='cancelling', cancelling_at=? WHERE id=?",
                    (now, batch_id),
                )
                # Not-yet-started work is dropped now; running requests finish and are kept.
                db.execute(
                    "UPDATE batch_requests SET state='cancelled' WHERE batch_id=? AND "
                    "state='pending'",
                    (batch_id,),
                )
            elif r[0] != "cancelling":
                raise Conflict(f"a batch that is {r[0]} cannot be cancelled")
            row = db.execute(f"SELECT {BATCH_COLS} FROM batches WHERE id=?", (batch_id,)).fetchone()
            return rows.batch_row(row)

        return await self._batch.write(q)

    async def team_holdings(self, team_id: str) -> tuple[int, int]:
        return await self._batch.read(
            lambda db: (team_bytes(db, team_id), open_batches(db, team_id))
        )


class SqliteBatchStore(SqliteBatchTables):
    """The batch tables alone, on one file (opened at its first use)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._batch = Connections(self.path, init_batch_tables)

    def close(self) -> None:
        self._batch.close_now()
