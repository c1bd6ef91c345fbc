"""Two gateways share one batch.sqlite3: a client cancels a batch on one while the other's
runner claims its lines. A cancel reads the batch's status, then writes; under a deferred
`BEGIN` it read a snapshot that the claim's commit made stale, and SQLite refused its write at
once (`database is locked`, SQLITE_BUSY_SNAPSHOT: no busy timeout helps): the client got a 500.
Every write of the SQLite batch tables now begins with `BEGIN IMMEDIATE` (the cancel, a file's
delete, a runner's release of its claims), so one waits for the other and both succeed.

The interleaving is built whatever the order the threads run in (as in
test_batch_store_immediate.py): each store's connection is traced, and the operation that
reaches its write first waits there until the other has read too (deferred) or has begun its
`BEGIN IMMEDIATE` and cannot read because the database is write-locked.

Real parts: two `SqliteBatchStore`s on one file (two connections, as two gateways have), each
on its own thread; a third connection only probes the write lock.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch
from tests.security.test_batch_store_immediate import write_locked
from tests.wait import wait_for

WITHIN_S = 30.0


class Racer:
    """One gateway's store and one operation on it, held between its read and its write."""

    def __init__(
        self, path: Path, name: str, write: str, op: Callable[[SqliteBatchStore], Awaitable[Any]]
    ) -> None:
        self.name, self.write, self.op = name, write, op
        self.store = SqliteBatchStore(path)
        self.began = threading.Event()
        self.read = threading.Event()
        self.other: Racer | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        asyncio.run(self.store._batch.run(lambda db: db.set_trace_callback(self._trace)))

    def _trace(self, sql: str) -> None:
        # Only an immediate BEGIN may wait for the lock; a deferred one always goes on to read.
        if sql.startswith("BEGIN IMMEDIATE"):
            self.began.set()
        elif sql.startswith(self.write) and not self.read.is_set():
            self.read.set()
            other = self.other
            assert other is not None
            try:
                wait_for(
                    lambda: (
                        other.read.is_set()
                        or (other.began.is_set() and write_locked(self.store.path))
                    ),
                    WITHIN_S,
                    f"{other.name} to read, or to wait for {self.name}'s lock",
                )
            except AssertionError as e:
                self.error = e

    def run(self, start: threading.Barrier) -> None:
        start.wait(WITHIN_S)
        try:
            self.result = asyncio.run(self.op(self.store))
        except BaseException as e:  # what the test reports: an operation that failed
            self.error = self.error or e


async def _lines(store: SqliteBatchStore) -> None:
    reqs = [
        NewRequest(line=i + 1, custom_id=f"c{i}", body={"model": "m", "prompt": "x"})
        for i in range(3)
    ]
    await store.create_batch(batch("batch_1", 0.0), reqs)


def test_a_cancel_racing_another_gateways_claim_succeeds(tmp_path: Path) -> None:
    path = tmp_path / "batch.sqlite3"
    cancel = Racer(
        path,
        "cancel",
        "UPDATE batches SET status='cancelling'",
        lambda s: s.cancel_batch("t", "batch_1", 2.0),
    )
    claim = Racer(
        path,
        "claim",
        "UPDATE batch_requests SET state='running'",
        lambda s: s.claim_requests("B", 1, lease_s=60, now=1.0),
    )
    cancel.other, claim.other = claim, cancel
    try:
        asyncio.run(_lines(cancel.store))
        start = threading.Barrier(2)
        threads = [threading.Thread(target=r.run, args=(start,)) for r in (cancel, claim)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WITHIN_S)
        assert not any(t.is_alive() for t in threads)
        # Old code: the cancel raised sqlite3.OperationalError: database is locked.
        assert cancel.error is None and claim.error is None, (cancel.error, claim.error)
        assert cancel.result is not None and cancel.result.status == "cancelling"
        row = asyncio.run(claim.store.get_batch("t", "batch_1"))
        assert row is not None and row.status == "cancelling"
        # Whichever went first, nothing is left to claim: the claim took a line or the cancel
        # dropped them all.
        assert asyncio.run(claim.store.claim_requests("C", 5, lease_s=60, now=3.0)) == []
    finally:
        cancel.store.close()
        claim.store.close()
