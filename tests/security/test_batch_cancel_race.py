"""Two gateways share one batch.sqlite3: a client cancels a batch on one while the other's
runner claims its lines. A cancel reads the batch's status, then writes; under a deferred
`BEGIN` it read a snapshot that the claim's commit made stale, and SQLite refused its write at
once (`database is locked`, SQLITE_BUSY_SNAPSHOT: no busy timeout helps): the client got a 500.
Every write of the SQLite batch tables now begins with `BEGIN IMMEDIATE` (the cancel, a file's
delete, a runner's release of its claims), so one waits for the other and both succeed.

The interleaving is built whatever the order the threads run in (tests/security/sqlite_race.py):
the operation that reaches its write first waits there until the other has read too (deferred)
or has begun its `BEGIN IMMEDIATE` and cannot read because the database is write-locked.

Real parts: two `SqliteBatchStore`s on one file (two connections, as two gateways have), each
on its own thread; a third connection only probes the write lock.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch
from tests.security.sqlite_race import Racer, race


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
    try:
        asyncio.run(_lines(cancel.store))
        race(cancel, claim)
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
