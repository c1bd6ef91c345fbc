"""The runner's half of the PostgreSQL batch tables (postgres_batch.py): claims and their
leases, results, finalizing a batch and its callback, and the counts the runner and /health
read; and the helpers both halves share."""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import asyncpg

from gateway.accounts.store import claim_order
from gateway.accounts.store.batch_tables import OPEN, BatchTables
from gateway.batch import rows
from gateway.batch.rows import (
    BATCH_COLS,
    CLAIM_COLS,
    RESULT_COLS,
    BatchRow,
    Claimed,
    FileRow,
    ResultRow,
)

#: a file not expired (OpenAI's `expires_after`), as of the query's `now` ($3)
LIVE = "(expires_at IS NULL OR expires_at > $3)"
#: the first key of the per-team advisory lock of batch-tier writes (an int4: 'dubt')
_TEAM_LOCK = 0x64756274


class PostgresBatchClaims(BatchTables):
    @abstractmethod
    async def _p(self) -> asyncpg.Pool:
        """The pool, the batch tables created."""

    async def release_claims(self, worker: str) -> int:
        async with (await self._p()).acquire() as con, con.transaction():
            n = tag_count(
                await con.execute(
                    "UPDATE batch_requests SET state='pending', claimed_by=NULL, "
                    "lease_until=NULL WHERE state='running' AND claimed_by=$1",
                    worker,
                )
            )
            await con.execute(
                "UPDATE batches SET claimed_by=NULL, lease_until=NULL WHERE claimed_by=$1", worker
            )
            return n

    async def claim_requests(
        self, worker: str, n: int, lease_s: float, now: float
    ) -> list[Claimed]:
        found = await (await self._p()).fetch(
            # the fair order (round-robin over teams) and its locks are claim_order.py's
            f"{claim_order.POSTGRES_CLAIM} RETURNING {CLAIM_COLS}, b.priority, b.seq",
            now,
            n,
            worker,
            now + lease_s,
            2 * n,
        )
        found = sorted(
            found, key=lambda r: (-r["priority"], r["seq"], r["line"])
        )  # runner order: oldest first
        return [rows.claimed(r, attempts=r["attempts"]) for r in found]

    async def renew_leases(
        self, worker: str, keys: Sequence[tuple[str, str]], until: float
    ) -> None:
        async with (await self._p()).acquire() as con:
            await con.executemany(
                "UPDATE batch_requests SET lease_until=$1 WHERE batch_id=$2 AND custom_id=$3 "
                "AND state='running' AND claimed_by=$4",
                [(until, b, c, worker) for b, c in keys],
            )

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
        async with (await self._p()).acquire() as con, con.transaction():
            # the batch's row first, as finish_batch and cancel_batch take them: no deadlock
            await con.execute("SELECT 1 FROM batches WHERE id=$1 FOR UPDATE", batch_id)
            tag = await con.execute(
                "UPDATE batch_requests SET state=$1, status_code=$2, request_id=$3, response=$4, "
                "error=$5, finished_at=$6, claimed_by=NULL, lease_until=NULL WHERE batch_id=$7 "
                "AND custom_id=$8 AND state='running' AND claimed_by=$9",
                "succeeded" if ok else "failed",
                status_code,
                request_id,
                resp,
                err,
                now,
                batch_id,
                custom_id,
                worker,
            )
            if tag_count(tag) != 1:
                return False
            # the result is held here until the batch ends: it counts in the team's storage
            # ... and the batch's counts are kept here, not counted per listed batch
            col = rows.count_col(ok)
            await con.execute(
                f"UPDATE batches SET body_bytes=body_bytes+$1, {col}={col}+1 WHERE id=$2",
                rows.text_bytes(resp, err),
                batch_id,
            )
            return True

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
        tag = await (await self._p()).execute(
            "UPDATE batch_requests SET state='pending', not_before=$1, error=$2, claimed_by=NULL, "
            "lease_until=NULL, attempts=attempts-$3 WHERE batch_id=$4 "
            "AND custom_id=$5 AND state='running' AND claimed_by=$6",
            not_before,
            rows.dumps(error),
            0 if spent else 1,
            batch_id,
            custom_id,
            worker,
        )
        return tag_count(tag) == 1

    async def claim_finalizable(self, worker: str, lease_s: float, now: float) -> list[str]:
        async with (await self._p()).acquire() as con, con.transaction():
            ids = [
                r[0]
                for r in await con.fetch(
                    "SELECT b.id FROM batches b WHERE b.status IN "
                    "('in_progress','finalizing','cancelling') "
                    "AND (b.lease_until IS NULL OR b.lease_until<$1) "
                    "AND NOT EXISTS (SELECT 1 FROM batch_requests r WHERE r.batch_id=b.id AND "
                    "  r.state='running' AND r.lease_until>=$1) "
                    "AND (b.status='cancelling' OR b.expires_at<=$1 OR NOT EXISTS ("
                    "  SELECT 1 FROM batch_requests r WHERE r.batch_id=b.id "
                    "AND r.state IN ('pending','running'))) FOR UPDATE OF b SKIP LOCKED",
                    now,
                )
            ]
            for bid in ids:
                await con.execute(
                    "UPDATE batches SET claimed_by=$1, lease_until=$2, finalizing_at=CASE "
                    "WHEN status='in_progress' AND expires_at>$3 THEN $3 "
                    "ELSE finalizing_at END, status=CASE WHEN status='in_progress' "
                    "AND expires_at>$3 THEN 'finalizing' ELSE status END WHERE id=$4",
                    worker,
                    now + lease_s,
                    now,
                    bid,
                )
            return ids

    async def results(self, batch_id: str) -> list[ResultRow]:
        found = await (await self._p()).fetch(
            f"SELECT {RESULT_COLS} FROM batch_requests WHERE batch_id=$1 ORDER BY line", batch_id
        )
        return [rows.result_row(r) for r in found]

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
        async with (await self._p()).acquire() as con, con.transaction():
            tag = await con.execute(
                f"UPDATE batches SET status=$1, {status}_at=$2, output_file_id=$3, "
                "error_file_id=$4, claimed_by=NULL, lease_until=NULL, callback_state=CASE "
                "WHEN callback_url IS NULL THEN NULL ELSE 'pending' END, callback_next_at=$2 "
                "WHERE id=$5 AND claimed_by=$6 AND status IN "
                "('in_progress','finalizing','cancelling')",
                status,
                now,
                output_file_id,
                error_file_id,
                batch_id,
                worker,
            )
            if tag_count(tag) != 1:
                return False
            # The lines go with the batch: their bodies were copies of the input file, their
            # results are in its files now, and its counts are its row's.
            await con.execute("DELETE FROM batch_requests WHERE batch_id=$1", batch_id)
            await con.execute("UPDATE batches SET body_bytes=0 WHERE id=$1", batch_id)
            for f in files:
                await insert_file_row(con, f)
            return True

    async def claim_callbacks(self, worker: str, lease_s: float, now: float) -> list[BatchRow]:
        async with (await self._p()).acquire() as con, con.transaction():
            found = await con.fetch(
                f"SELECT {BATCH_COLS} FROM batches WHERE callback_state='pending' AND "
                "callback_next_at<=$1 AND (lease_until IS NULL OR lease_until<$1) "
                "FOR UPDATE SKIP LOCKED",
                now,
            )
            for r in found:
                await con.execute(
                    "UPDATE batches SET claimed_by=$1, lease_until=$2, "
                    "callback_attempts=callback_attempts+1 WHERE id=$3",
                    worker,
                    now + lease_s,
                    r[0],
                )
            return [rows.batch_row(r) for r in found]

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
        await (await self._p()).execute(
            "UPDATE batches SET callback_state=$1, callback_next_at=$2, callback_error=$3, "
            "claimed_by=NULL, lease_until=NULL WHERE id=$4 AND claimed_by=$5",
            state,
            next_at,
            error,
            batch_id,
            worker,
        )

    async def mean_request_seconds(self, since: float) -> float | None:
        return await (await self._p()).fetchval(
            "SELECT AVG(finished_at - started_at) FROM batch_requests WHERE state='succeeded' AND "
            "finished_at>=$1",
            since,
        )

    async def pending_requests(self) -> int:
        return int(
            await (await self._p()).fetchval(
                "SELECT COALESCE(SUM(total - n_succeeded - n_failed), 0) FROM batches "
                "WHERE status='in_progress'"
            )
        )


def marks(n: int) -> str:
    return ",".join(f"${i}" for i in range(1, n + 1))


def tag_count(tag: str) -> int:
    """Rows a statement touched, from its status tag ("UPDATE 3")."""
    return int(tag.rsplit(" ", 1)[-1])


async def lock_team(con: Any, team_id: str) -> None:
    """The team's batch-tier writes, one at a time until this transaction ends (store.TeamLimit):
    READ COMMITTED alone would let two transactions count, then both insert."""
    await con.execute("SELECT pg_advisory_xact_lock($1, hashtext($2))", _TEAM_LOCK, team_id)


async def team_bytes(con: Any, team_id: str) -> int:
    """The team's live files, and the request bodies its batches hold until they end."""
    files = await con.fetchval(
        "SELECT COALESCE(SUM(bytes), 0) FROM batch_files WHERE team_id=$1 AND NOT "
        "deleted AND (expires_at IS NULL OR expires_at > $2)",
        team_id,
        time.time(),
    )
    bodies = await con.fetchval(
        "SELECT COALESCE(SUM(body_bytes), 0) FROM batches WHERE team_id=$1 AND body_bytes>0",
        team_id,
    )
    return int(files) + int(bodies)


async def open_batches(con: Any, team_id: str) -> int:
    return int(
        await con.fetchval(
            "SELECT COUNT(*) FROM batches WHERE team_id=$1 AND status = ANY($2::text[])",
            team_id,
            list(OPEN),
        )
    )


async def insert_file_row(con: Any, f: FileRow) -> None:
    await con.execute(rows.insert_file_sql(marks), *rows.file_values(f))


async def cursor_of(con: Any, table: str, team_id: str, after: str | None) -> int:
    """The seq to list below; an unknown `after` (or another team's) lists from the top."""
    if after is not None:
        seq = await con.fetchval(
            f"SELECT seq FROM {table} WHERE id=$1 AND team_id=$2", after, team_id
        )
        if seq is not None:
            return int(seq)
    return 2**62
