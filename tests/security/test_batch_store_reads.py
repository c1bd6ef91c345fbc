"""The batch store's reads a client can cause on every poll (`GET /v1/batch/{id}`'s results,
the counts behind `POST /v1/batch`'s `estimated_completion`) take no write lock: while another
gateway holds the lock of a shared batch.sqlite3 (a claim, a finish, a batch being created from
a large file), they answer from a snapshot. They ran in `BEGIN IMMEDIATE` before: each waited
for the lock (up to the 30 s busy timeout), and each held it meanwhile, stalling every other
gateway's claims and finishes behind a client's polling.

Real parts: a `SqliteBatchStore` on a file, and a second connection holding its write lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch

#: far below the store's 30 s busy timeout: a read that waits for the lock misses it
ANSWER_WITHIN_S = 5.0


async def test_polls_read_while_another_gateway_holds_the_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "batch.sqlite3"
    store = SqliteBatchStore(path)
    try:
        reqs = [NewRequest(line=1, custom_id="c", body={"model": "m", "prompt": "x"})]
        await store.create_batch(batch("batch_1", 0.0), reqs)
        with contextlib.closing(sqlite3.connect(str(path), isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")  # another gateway, mid-write
            other.execute("UPDATE batches SET lease_until=1 WHERE id='batch_1'")
            results, pending, mean = await asyncio.wait_for(
                asyncio.gather(
                    store.results("batch_1"),
                    store.pending_requests(),
                    store.mean_request_seconds(0.0),
                ),
                ANSWER_WITHIN_S,
            )
            other.execute("ROLLBACK")
        assert [r.custom_id for r in results] == ["c"] and pending == 1 and mean is None
    finally:
        store.close()
