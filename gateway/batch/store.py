"""Durable state of the batch tier: files, batches and one row per request (its claim and,
once finished, its result). `BatchStore` is the interface; `SqliteBatchStore` is the default
(stdlib sqlite3 in WAL mode, each call in a worker thread). A PostgreSQL store implements the
same methods (claims with `SELECT ... FOR UPDATE SKIP LOCKED`). The rows and their mapping to
columns are rows.py's, shared by both.

Invariants:
- (batch_id, custom_id) is the primary key of `batch_requests`: one row, hence at most one
  result and one output line, per custom_id.
- A request runs only while claimed: `state='running'`, `claimed_by` = the runner, and
  `lease_until` in the future. A result is written only by the runner that holds the claim
  (`finish_request` checks it in the same statement), so a runner whose lease was taken over
  cannot write a second result.
- Every state change is one transaction (`BEGIN IMMEDIATE`): several gateway processes may
  share the database file. A deferred `BEGIN` would let a second claim read while the first is
  between its read and its write; its write would then meet a stale snapshot and fail
  (`database is locked`) — tests/security/test_batch_store_immediate.py.
- Teams are isolated here, not in the handlers: every read a client can cause names its team.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar

from gateway.accounts.store.private_files import private_dir, private_file
from gateway.batch import rows
from gateway.batch.rows import (
    BATCH_COLS,
    CLAIM_COLS,
    FILE_COLS,
    REQUEST_INSERT_COLS,
    RESULT_COLS,
    BatchRow,
    Claimed,
    FileRow,
    NewRequest,
    ResultRow,
)

T = TypeVar("T")

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
    callback_error TEXT
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

#: a file not expired (OpenAI's `expires_after`), as of the query's `now` parameter
LIVE = "(expires_at IS NULL OR expires_at > ?)"
#: batch states that hold a team's open-batch allowance (`[batch] max_open_batches`)
OPEN = ("validating", "in_progress", "finalizing", "cancelling")


class Conflict(Exception):
    """The batch is in a state that does not allow the change."""


class TeamLimit(Exception):
    """A write would take the team past one of its batch-tier bounds (`[batch] max_team_bytes`,
    `max_open_batches`). Checked in the write's own transaction, under a lock on the team's
    writes (SQLite's write lock; a per-team advisory lock on PostgreSQL), so requests racing
    each other, on one gateway or several, cannot pass a bound together."""

    def __init__(self, kind: Literal["bytes", "open_batches"], held: int) -> None:
        super().__init__(f"{kind}: {held} held")
        self.kind = kind
        #: what the team held before this write (bytes stored, or batches not yet ended)
        self.held = held


class BatchStore(Protocol):
    """What the routes and the runner need from storage. `now` is unix seconds (the caller's
    clock, so tests and several gateways agree on one source)."""

    async def insert_file(self, row: FileRow, max_team_bytes: int | None = None) -> None:
        """Store a file's row; with `max_team_bytes`, raise TeamLimit (nothing written) if the
        team's live files would then hold more."""

    async def get_file(self, team_id: str, file_id: str) -> FileRow | None: ...
    async def list_files(
        self, team_id: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileRow], bool]: ...
    async def delete_file(self, team_id: str, file_id: str) -> bool: ...
    async def purge_expired_files(self, now: float, limit: int = 100) -> list[str]:
        """Mark up to `limit` files expired by `now` deleted and return their ids (their contents
        on disk are the caller's to remove): an expired file no longer counts in its team's
        storage, so its bytes must not stay on disk either."""

    async def create_batch(
        self, row: BatchRow, requests: Sequence[NewRequest], max_open: int | None = None
    ) -> None:
        """Write a batch and its requests; with `max_open`, raise TeamLimit (nothing written)
        if an open batch would make the team's open batches more than `max_open`."""

    async def get_batch(self, team_id: str | None, batch_id: str) -> BatchRow | None: ...
    async def list_batches(
        self, team_id: str, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]: ...
    async def cancel_batch(self, team_id: str, batch_id: str, now: float) -> BatchRow | None: ...
    async def release_claims(self, worker: str) -> int: ...
    async def claim_requests(
        self, worker: str, n: int, lease_s: float, now: float
    ) -> list[Claimed]: ...
    async def renew_leases(
        self, worker: str, keys: Sequence[tuple[str, str]], until: float
    ) -> None: ...
    async def finish_request(
        self,
        worker: str,
        batch_id: str,
        custom_id: str,
        *,
        ok: bool,
        status_code: int | None,
        request_id: str | None,
        response: dict[str, Any] | None,
        error: dict[str, Any] | None,
        now: float,
    ) -> bool: ...
    async def retry_request(
        self,
        worker: str,
        batch_id: str,
        custom_id: str,
        not_before: float,
        error: dict[str, Any],
        *,
        spent: bool = True,
    ) -> bool:
        """Back to pending until `not_before`; `spent=False` gives the claim's attempt back
        (the request never ran: a quota window or load shedding deferred it)."""

    async def claim_finalizable(self, worker: str, lease_s: float, now: float) -> list[str]: ...
    async def results(self, batch_id: str) -> list[ResultRow]: ...
    async def finish_batch(
        self,
        worker: str,
        batch_id: str,
        status: str,
        files: Sequence[FileRow],
        output_file_id: str | None,
        error_file_id: str | None,
        now: float,
    ) -> bool: ...
    async def claim_callbacks(self, worker: str, lease_s: float, now: float) -> list[BatchRow]: ...
    async def callback_result(
        self,
        worker: str,
        batch_id: str,
        *,
        delivered: bool,
        next_at: float | None,
        error: str | None,
    ) -> None: ...
    async def mean_request_seconds(self, since: float) -> float | None: ...
    async def pending_requests(self) -> int: ...
    async def team_holdings(self, team_id: str) -> tuple[int, int]:
        """(bytes of the team's stored files, its batches not yet ended): its per-team limits."""
        ...

    def close(self) -> None: ...


def _marks(n: int) -> str:
    return ",".join("?" * n)


class SqliteBatchStore:
    """`BatchStore` on one SQLite file (WAL, so readers never block the writer)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        private_file(private_dir(self.path.parent) / self.path.name)
        # isolation_level=None: we issue BEGIN IMMEDIATE ourselves, so a claim takes the write
        # lock before it reads: another process's claim waits, then reads what this one left.
        self._db = sqlite3.connect(
            str(self.path), timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._lock = threading.Lock()  # one connection, used by one thread at a time
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode loses nothing when a process is killed; only an OS crash may drop
        # the last transactions, which the runner then simply redoes.
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        if "expires_at" not in {r[1] for r in self._db.execute("PRAGMA table_info(batch_files)")}:
            self._db.execute(
                "ALTER TABLE batch_files ADD COLUMN expires_at REAL"
            )  # a store made before it

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx_sync(self, fn: Callable[[sqlite3.Connection], T], write: bool = True) -> T:
        with self._lock:
            # Reads take a deferred transaction: in WAL mode they never wait for writers.
            self._db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                out = fn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return out

    async def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self._tx_sync, fn)

    async def _read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await asyncio.to_thread(self._tx_sync, fn, False)

    # ---- files ----
    async def insert_file(self, row: FileRow, max_team_bytes: int | None = None) -> None:
        def q(db: sqlite3.Connection) -> None:
            # under BEGIN IMMEDIATE: the write lock is held from this read to the insert
            if max_team_bytes is not None:
                held = _team_bytes(db, row.team_id)
                if held + row.bytes > max_team_bytes:
                    raise TeamLimit("bytes", held)
            _insert_file(db, row)

        await self._tx(q)

    async def get_file(self, team_id: str, file_id: str) -> FileRow | None:
        def q(db: sqlite3.Connection) -> FileRow | None:
            r = db.execute(
                f"SELECT {FILE_COLS} FROM batch_files WHERE id=? AND team_id=? "
                f"AND deleted=0 AND {LIVE}",
                (file_id, team_id, time.time()),
            ).fetchone()
            return FileRow(*r) if r else None

        return await self._read(q)

    async def list_files(
        self, team_id: str, purpose: str | None, after: str | None, limit: int
    ) -> tuple[list[FileRow], bool]:
        def q(db: sqlite3.Connection) -> tuple[list[FileRow], bool]:
            cursor = _cursor(db, "batch_files", team_id, after)
            found = db.execute(
                f"SELECT {FILE_COLS} FROM batch_files WHERE team_id=? AND deleted=0 AND seq<? "
                f"AND (? IS NULL OR purpose=?) AND {LIVE} ORDER BY seq DESC LIMIT ?",
                (team_id, cursor, purpose, purpose, time.time(), limit + 1),
            ).fetchall()
            return [FileRow(*r) for r in found[:limit]], len(found) > limit

        return await self._read(q)

    async def delete_file(self, team_id: str, file_id: str) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            return (
                db.execute(
                    "UPDATE batch_files SET deleted=1 WHERE id=? AND team_id=? AND deleted=0",
                    (file_id, team_id),
                ).rowcount
                == 1
            )

        return await self._read(q)

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

        return await self._tx(
            q
        )  # the write lock from the read on: two gateways never purge one file twice

    # ---- batches ----
    async def create_batch(
        self, row: BatchRow, requests: Sequence[NewRequest], max_open: int | None = None
    ) -> None:
        def q(db: sqlite3.Connection) -> None:
            if max_open is not None and row.status in OPEN:  # under the write lock, like the insert
                held = _open_batches(db, row.team_id)
                if held >= max_open:
                    raise TeamLimit("open_batches", held)
            db.execute(rows.insert_batch_sql(_marks), rows.batch_values(row, len(requests)))
            db.executemany(
                f"INSERT INTO batch_requests ({', '.join(REQUEST_INSERT_COLS)}) VALUES (?,?,?,?)",
                rows.request_values(row.id, requests),
            )
            if rows.callback_starts_at_creation(row):
                db.execute(
                    "UPDATE batches SET callback_state='pending', callback_next_at=? WHERE id=?",
                    (row.created_at, row.id),
                )

        await self._tx(q)

    async def get_batch(self, team_id: str | None, batch_id: str) -> BatchRow | None:
        def q(db: sqlite3.Connection) -> BatchRow | None:
            r = db.execute(
                f"SELECT {BATCH_COLS} FROM batches WHERE id=? AND (? IS NULL OR team_id=?)",
                (batch_id, team_id, team_id),
            ).fetchone()
            return _batch_row(db, r) if r else None

        return await self._read(q)

    async def list_batches(
        self, team_id: str, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        def q(db: sqlite3.Connection) -> tuple[list[BatchRow], bool]:
            cursor = _cursor(db, "batches", team_id, after)
            found = db.execute(
                f"SELECT {BATCH_COLS} FROM batches WHERE team_id=? AND seq<? "
                "ORDER BY seq DESC LIMIT ?",
                (team_id, cursor, limit + 1),
            ).fetchall()
            return [_batch_row(db, r) for r in found[:limit]], len(found) > limit

        return await self._read(q)

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
            return _batch_row(db, row)

        return await self._read(q)

    # ---- runner ----
    async def release_claims(self, worker: str) -> int:
        """Hand back everything `worker` holds: called when a runner (re)starts, since the
        previous process with its id is gone."""

        def q(db: sqlite3.Connection) -> int:
            n = db.execute(
                "UPDATE batch_requests SET state='pending', claimed_by=NULL, "
                "lease_until=NULL WHERE state='running' AND claimed_by=?",
                (worker,),
            ).rowcount
            db.execute(
                "UPDATE batches SET claimed_by=NULL, lease_until=NULL WHERE claimed_by=?", (worker,)
            )
            return n

        return await self._read(q)

    async def claim_requests(
        self, worker: str, n: int, lease_s: float, now: float
    ) -> list[Claimed]:
        def q(db: sqlite3.Connection) -> list[Claimed]:
            # Round-robin over teams (`turn`: a line's rank in its team's own queue after the
            # lines the team already has running), so one team's 50,000-line batch cannot
            # starve another team's batch queued after it, in one claim or over many. Equal turns
            # go to the team whose last line started longest ago (`served`; never: first): with
            # nothing running every team's next line has turn 1, and the oldest batch winning
            # that tie served one team's whole batch to a runner claiming a line at a time.
            found = db.execute(
                f"SELECT {CLAIM_COLS} FROM (SELECT {CLAIM_COLS}, b.priority AS prio, b.seq AS bseq, "
                "  COALESCE(k.busy, 0) + ROW_NUMBER() OVER ("
                "    PARTITION BY b.team_id ORDER BY b.priority DESC, b.seq, r.line) AS turn, "
                "  COALESCE(l.served, -1) AS served "
                "  FROM batch_requests r JOIN batches b ON b.id = r.batch_id LEFT JOIN ("
                "    SELECT b2.team_id, COUNT(*) AS busy FROM batch_requests r2 JOIN batches b2 ON b2.id = r2.batch_id "
                "    WHERE r2.state='running' AND r2.lease_until>=? GROUP BY b2.team_id) k ON k.team_id = b.team_id "
                "  LEFT JOIN ("
                "    SELECT b3.team_id, MAX(r3.started_at) AS served FROM batch_requests r3 "
                "    JOIN batches b3 ON b3.id = r3.batch_id WHERE b3.status='in_progress' GROUP BY b3.team_id"
                "  ) l ON l.team_id = b.team_id "
                "  WHERE b.status='in_progress' AND b.expires_at>? AND ("
                "  (r.state='pending' AND r.not_before<=?) OR (r.state='running' AND r.lease_until<?))) r "
                "JOIN batches b ON b.id = r.batch_id "
                "ORDER BY r.prio DESC, r.turn, r.served, r.bseq, r.line LIMIT ?",
                (now, now, now, now, n),
            ).fetchall()
            out = []
            for r in found:
                rid = (
                    r[7] or rows.new_request_id()
                )  # a rerun keeps its key (rows.Claimed.request_id)
                db.execute(
                    "UPDATE batch_requests SET state='running', claimed_by=?, lease_until=?, "
                    "attempts=attempts+1, started_at=?, request_id=? WHERE batch_id=? AND custom_id=?",
                    (worker, now + lease_s, now, rid, r[0], r[1]),
                )
                out.append(rows.claimed(r, attempts=r[4] + 1, request_id=rid))
            return out

        return await self._tx(q)

    async def renew_leases(
        self, worker: str, keys: Sequence[tuple[str, str]], until: float
    ) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.executemany(
                "UPDATE batch_requests SET lease_until=? WHERE batch_id=? AND custom_id=? "
                "AND state='running' AND claimed_by=?",
                ((until, b, c, worker) for b, c in keys),
            )

        await self._tx(q)

    async def finish_request(
        self,
        worker: str,
        batch_id: str,
        custom_id: str,
        *,
        ok: bool,
        status_code: int | None,
        request_id: str | None,
        response: dict[str, Any] | None,
        error: dict[str, Any] | None,
        now: float,
    ) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            return (
                db.execute(
                    "UPDATE batch_requests SET state=?, status_code=?, request_id=?, response=?, "
                    "error=?, finished_at=?, claimed_by=NULL, lease_until=NULL "
                    "WHERE batch_id=? AND custom_id=? AND state='running' AND claimed_by=?",
                    (
                        "succeeded" if ok else "failed",
                        status_code,
                        request_id,
                        rows.dumps(response),
                        rows.dumps(error),
                        now,
                        batch_id,
                        custom_id,
                        worker,
                    ),
                ).rowcount
                == 1
            )

        return await self._tx(q)

    async def retry_request(
        self,
        worker: str,
        batch_id: str,
        custom_id: str,
        not_before: float,
        error: dict[str, Any],
        *,
        spent: bool = True,
    ) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            return (
                db.execute(
                    "UPDATE batch_requests SET state='pending', not_before=?, error=?, claimed_by=NULL, "
                    "lease_until=NULL, request_id=NULL, attempts=attempts-? WHERE batch_id=? AND custom_id=? AND "
                    "state='running' AND claimed_by=?",
                    (not_before, rows.dumps(error), 0 if spent else 1, batch_id, custom_id, worker),
                ).rowcount
                == 1
            )

        return await self._tx(q)

    async def claim_finalizable(self, worker: str, lease_s: float, now: float) -> list[str]:
        """Batches with nothing left to run (all done, cancelled, or past their window) and no
        live claim on them or their requests; claimed for `lease_s` by `worker`."""

        def q(db: sqlite3.Connection) -> list[str]:
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT b.id FROM batches b WHERE b.status IN ('in_progress','finalizing','cancelling') "
                    "AND (b.lease_until IS NULL OR b.lease_until<?) "
                    "AND NOT EXISTS (SELECT 1 FROM batch_requests r WHERE r.batch_id=b.id AND "
                    "  r.state='running' AND r.lease_until>=?) "
                    "AND (b.status='cancelling' OR b.expires_at<=? OR NOT EXISTS ("
                    "  SELECT 1 FROM batch_requests r WHERE r.batch_id=b.id AND r.state IN ('pending','running')))",
                    (now, now, now),
                ).fetchall()
            ]
            for bid in ids:
                db.execute(
                    "UPDATE batches SET claimed_by=?, lease_until=?, finalizing_at=CASE WHEN "
                    "status='in_progress' AND expires_at>? THEN ? ELSE finalizing_at END, "
                    "status=CASE WHEN status='in_progress' AND expires_at>? THEN 'finalizing' "
                    "ELSE status END WHERE id=?",
                    (worker, now + lease_s, now, now, now, bid),
                )
            return ids

        return await self._tx(q)

    async def results(self, batch_id: str) -> list[ResultRow]:
        def q(db: sqlite3.Connection) -> list[ResultRow]:
            found = db.execute(
                f"SELECT {RESULT_COLS} FROM batch_requests WHERE batch_id=? ORDER BY line",
                (batch_id,),
            ).fetchall()
            return [rows.result_row(r) for r in found]

        return await self._tx(q)

    async def finish_batch(
        self,
        worker: str,
        batch_id: str,
        status: str,
        files: Sequence[FileRow],
        output_file_id: str | None,
        error_file_id: str | None,
        now: float,
    ) -> bool:
        rows.check_final(status)

        def q(db: sqlite3.Connection) -> bool:
            n = db.execute(
                f"UPDATE batches SET status=?, {status}_at=?, output_file_id=?, error_file_id=?, "
                "claimed_by=NULL, lease_until=NULL, callback_state=CASE WHEN callback_url IS NULL "
                "THEN NULL ELSE 'pending' END, callback_next_at=? "
                "WHERE id=? AND claimed_by=? AND status IN ('in_progress','finalizing','cancelling')",
                (status, now, output_file_id, error_file_id, now, batch_id, worker),
            ).rowcount
            if n != 1:
                return False
            # Requests that never ran now say why, so counts and files agree after the end.
            db.execute(
                "UPDATE batch_requests SET state=?, claimed_by=NULL, lease_until=NULL "
                "WHERE batch_id=? AND state IN ('pending','running','cancelled')",
                (rows.leftover_state(status), batch_id),
            )
            for f in files:
                _insert_file(db, f)
            return True

        return await self._tx(q)

    async def claim_callbacks(self, worker: str, lease_s: float, now: float) -> list[BatchRow]:
        def q(db: sqlite3.Connection) -> list[BatchRow]:
            found = db.execute(
                f"SELECT {BATCH_COLS} FROM batches WHERE callback_state='pending' "
                "AND callback_next_at<=? AND (lease_until IS NULL OR lease_until<?)",
                (now, now),
            ).fetchall()
            for r in found:
                db.execute(
                    "UPDATE batches SET claimed_by=?, lease_until=?, "
                    "callback_attempts=callback_attempts+1 WHERE id=?",
                    (worker, now + lease_s, r[0]),
                )
            return [_batch_row(db, r) for r in found]

        return await self._tx(q)

    async def callback_result(
        self,
        worker: str,
        batch_id: str,
        *,
        delivered: bool,
        next_at: float | None,
        error: str | None,
    ) -> None:
        state = rows.callback_state(delivered, next_at)

        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "UPDATE batches SET callback_state=?, callback_next_at=?, callback_error=?, "
                "claimed_by=NULL, lease_until=NULL WHERE id=? AND claimed_by=?",
                (state, next_at, error, batch_id, worker),
            )

        await self._tx(q)

    async def mean_request_seconds(self, since: float) -> float | None:
        def q(db: sqlite3.Connection) -> float | None:
            r = db.execute(
                "SELECT AVG(finished_at - started_at) FROM batch_requests "
                "WHERE state='succeeded' AND finished_at>=?",
                (since,),
            ).fetchone()
            return r[0]

        return await self._tx(q)

    async def team_holdings(self, team_id: str) -> tuple[int, int]:
        return await self._read(lambda db: (_team_bytes(db, team_id), _open_batches(db, team_id)))

    async def pending_requests(self) -> int:
        def q(db: sqlite3.Connection) -> int:
            return db.execute(
                "SELECT COUNT(*) FROM batch_requests r JOIN batches b ON b.id=r.batch_id "
                "WHERE b.status='in_progress' AND r.state IN ('pending','running')"
            ).fetchone()[0]

        return await self._tx(q)


def _team_bytes(db: sqlite3.Connection, team_id: str) -> int:
    return int(
        db.execute(
            f"SELECT COALESCE(SUM(bytes), 0) FROM batch_files WHERE team_id=? AND NOT deleted "
            f"AND {LIVE}",
            (team_id, time.time()),
        ).fetchone()[0]
    )


def _open_batches(db: sqlite3.Connection, team_id: str) -> int:
    return int(
        db.execute(
            f"SELECT COUNT(*) FROM batches WHERE team_id=? AND status IN ({_marks(len(OPEN))})",
            (team_id, *OPEN),
        ).fetchone()[0]
    )


def _insert_file(db: sqlite3.Connection, f: FileRow) -> None:
    db.execute(rows.insert_file_sql(_marks), rows.file_values(f))


def _cursor(db: sqlite3.Connection, table: str, team_id: str, after: str | None) -> int:
    """The seq to list below; an unknown `after` (or another team's) lists from the top."""
    if after is not None:
        r = db.execute(
            f"SELECT seq FROM {table} WHERE id=? AND team_id=?", (after, team_id)
        ).fetchone()
        if r:
            return int(r[0])
    return 2**62


def _batch_row(db: sqlite3.Connection, r: Sequence[Any]) -> BatchRow:
    counts = dict(
        db.execute(
            "SELECT state, COUNT(*) FROM batch_requests WHERE batch_id=? GROUP BY state", (r[0],)
        ).fetchall()
    )
    return rows.batch_row(r, counts)
