"""The runner's half of the SQLite batch tables (sqlite_batch.py): claims and their leases,
results, finalizing a batch and its callback, and the counts the runner and /health read.

Every write takes the write lock before it reads (`Connections.write`); the reads (a batch's
results, the counts behind `estimated_completion`) take none: in WAL mode they read a snapshot
while other gateways claim and finish."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Sequence
from typing import Any

from gateway.accounts.store import claim_order
from gateway.accounts.store.batch_tables import OPEN, BatchTables
from gateway.accounts.store.sqlite_conn import Connections
from gateway.batch import rows
from gateway.batch.rows import (
    BATCH_COLS,
    RESULT_COLS,
    BatchRow,
    Claimed,
    FileRow,
    ResultRow,
)

#: a file not expired (OpenAI's `expires_after`), as of the query's `now` parameter
LIVE = "(expires_at IS NULL OR expires_at > ?)"


class SqliteBatchClaims(BatchTables):
    _batch: Connections

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

        return await self._batch.write(q)

    async def claim_requests(
        self, worker: str, n: int, lease_s: float, now: float
    ) -> list[Claimed]:
        def q(db: sqlite3.Connection) -> list[Claimed]:
            # the fair order (round-robin over teams) is claim_order.py's
            found = [
                db.execute(claim_order.LINE, key).fetchone() for key in claim_order.pick(db, n, now)
            ]
            out = []
            for r in found:
                rid = (
                    r[7] or rows.new_request_id()
                )  # a rerun keeps its key (rows.Claimed.request_id)
                db.execute(
                    "UPDATE batch_requests SET state='running', claimed_by=?, lease_until=?, "
                    "attempts=attempts+1, started_at=?, request_id=? WHERE batch_id=? "
                    "AND custom_id=?",
                    (worker, now + lease_s, now, rid, r[0], r[1]),
                )
                out.append(rows.claimed(r, attempts=r[4] + 1, request_id=rid))
            return out

        return await self._batch.write(q)

    async def renew_leases(
        self, worker: str, keys: Sequence[tuple[str, str]], until: float
    ) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.executemany(
                "UPDATE batch_requests SET lease_until=? WHERE batch_id=? AND custom_id=? "
                "AND state='running' AND claimed_by=?",
                ((until, b, c, worker) for b, c in keys),
            )

        await self._batch.write(q)

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
        resp, err = rows.dumps(response), rows.dumps(error)

        def q(db: sqlite3.Connection) -> bool:
            if (
                db.execute(
                    "UPDATE batch_requests SET state=?, status_code=?, request_id=?, response=?, "
                    "error=?, finished_at=?, claimed_by=NULL, lease_until=NULL "
                    "WHERE batch_id=? AND custom_id=? AND state='running' AND claimed_by=?",
                    (
                        "succeeded" if ok else "failed",
                        status_code,
                        request_id,
                        resp,
                        err,
                        now,
                        batch_id,
                        custom_id,
                        worker,
                    ),
                ).rowcount
                != 1
            ):
                return False
            # the result is held here until the batch ends: it counts in the team's storage
            # ... and the batch's counts are kept here, not counted per listed batch
            col = rows.count_col(ok)
            db.execute(
                f"UPDATE batches SET body_bytes=body_bytes+?, {col}={col}+1 WHERE id=?",
                (rows.text_bytes(resp, err), batch_id),
            )
            return True

        return await self._batch.write(q)

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
                    "UPDATE batch_requests SET state='pending', not_before=?, error=?, "
                    "claimed_by=NULL, lease_until=NULL, attempts=attempts-? "
                    "WHERE batch_id=? AND custom_id=? AND state='running' AND claimed_by=?",
                    (not_before, rows.dumps(error), 0 if spent else 1, batch_id, custom_id, worker),
                ).rowcount
                == 1
            )

        return await self._batch.write(q)

    async def claim_finalizable(self, worker: str, lease_s: float, now: float) -> list[str]:
        """Batches with nothing left to run (all done, cancelled, or past their window) and no
        live claim on them or their requests; claimed for `lease_s` by `worker`."""

        def q(db: sqlite3.Connection) -> list[str]:
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT b.id FROM batches b WHERE b.status IN "
                    "('in_progress','finalizing','cancelling') "
                    "AND (b.lease_until IS NULL OR b.lease_until<?) "
                    "AND NOT EXISTS (SELECT 1 FROM batch_requests r WHERE r.batch_id=b.id AND "
                    "  r.state='running' AND r.lease_until>=?) "
                    "AND (b.status='cancelling' OR b.expires_at<=? OR NOT EXISTS ("
                    "  SELECT 1 FROM batch_requests r WHERE r.batch_id=b.id "
                    "AND r.state IN ('pending','running')))",
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

        return await self._batch.write(q)

    async def results(self, batch_id: str) -> list[ResultRow]:
        def q(db: sqlite3.Connection) -> list[ResultRow]:
            found = db.execute(
                f"SELECT {RESULT_COLS} FROM batch_requests WHERE batch_id=? ORDER BY line",
                (batch_id,),
            ).fetchall()
            return [rows.result_row(r) for r in found]

        return await self._batch.read(q)

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
                "THEN NULL ELSE 'pending' END, callback_next_at=? WHERE id=? AND claimed_by=? "
                "AND status IN ('in_progress','finalizing','cancelling')",
                (status, now, output_file_id, error_file_id, now, batch_id, worker),
            ).rowcount
            if n != 1:
                return False
            # The lines go with the batch: their bodies were copies of the input file, their
            # results are in its files now, and its counts are its row's.
            db.execute("DELETE FROM batch_requests WHERE batch_id=?", (batch_id,))
            db.execute("UPDATE batches SET body_bytes=0 WHERE id=?", (batch_id,))
            for f in files:
                insert_file_row(db, f)
            return True

        return await self._batch.write(q)

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
            return [rows.batch_row(r) for r in found]

        return await self._batch.write(q)

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

        await self._batch.write(q)

    async def mean_request_seconds(self, since: float) -> float | None:
        def q(db: sqlite3.Connection) -> float | None:
            r = db.execute(
                "SELECT AVG(finished_at - started_at) FROM batch_requests "
                "WHERE state='succeeded' AND finished_at>=?",
                (since,),
            ).fetchone()
            return r[0]

        return await self._batch.read(q)

    async def pending_requests(self) -> int:
        def q(db: sqlite3.Connection) -> int:
            return db.execute(
                "SELECT COALESCE(SUM(total - n_succeeded - n_failed), 0) FROM batches "
                "WHERE status='in_progress'"
            ).fetchone()[0]

        return await self._batch.read(q)


def marks(n: int) -> str:
    return ",".join("?" * n)


def team_bytes(db: sqlite3.Connection, team_id: str) -> int:
    """The team's live files, and the request bodies its batches hold until they end."""
    files = db.execute(
        f"SELECT COALESCE(SUM(bytes), 0) FROM batch_files WHERE team_id=? AND NOT deleted "
        f"AND {LIVE}",
        (team_id, time.time()),
    ).fetchone()[0]
    bodies = db.execute(
        "SELECT COALESCE(SUM(body_bytes), 0) FROM batches WHERE team_id=? AND body_bytes>0",
        (team_id,),
    ).fetchone()[0]
    return int(files) + int(bodies)


def open_batches(db: sqlite3.Connection, team_id: str) -> int:
    return int(
        db.execute(
            f"SELECT COUNT(*) FROM batches WHERE team_id=? AND status IN ({marks(len(OPEN))})",
            (team_id, *OPEN),
        ).fetchone()[0]
    )


def insert_file_row(db: sqlite3.Connection, f: FileRow) -> None:
    db.execute(rows.insert_file_sql(marks), rows.file_values(f))


def cursor_of(db: sqlite3.Connection, table: str, team_id: str, after: str | None) -> int:
    """The seq to list below; an unknown `after` (or another team's) lists from the top."""
    if after is not None:
        r = db.execute(
            f"SELECT seq FROM {table} WHERE id=? AND team_id=?", (after, team_id)
        ).fetchone()
        if r:
            return int(r[0])
    return 2**62
