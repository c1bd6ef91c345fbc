"""Why the SQLite batch store's writes begin with `BEGIN IMMEDIATE`
(gateway/accounts/store/sqlite_conn.py `Connections.write`): two gateways (or two workers) on
one database file claim batch lines, each claim a read of the claimable lines and then a write
of the claim, in one transaction. Under a plain (deferred) `BEGIN` the second claim can read
while the first is between its read and its write; the first commits, and the second's write
then finds its snapshot stale: SQLite refuses it (`database is locked`, at once: a busy timeout
cannot help a stale snapshot) and that runner's claim fails. `BEGIN IMMEDIATE` takes the write
lock before the read: the second claim waits for the first, then reads what it left.

The test builds exactly that interleaving, whatever the order the threads run in
(tests/security/sqlite_race.py): the claim that reaches its write first waits there until the
other claim has read too (deferred), or has begun its transaction and cannot read because the
database is write-locked (immediate). Then both go on: exactly one gets the line, the other
gets nothing, neither fails, and the line is claimed once. With `BEGIN` in place of
`BEGIN IMMEDIATE` one claim raises `sqlite3.OperationalError: database is locked`.

Real parts: two `SqliteBatchStore`s on one file (two connections, as two gateways have), each
claiming on its own thread; a third connection only probes the write lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch
from tests.security.sqlite_race import Racer, race

CLAIM = "UPDATE batch_requests SET state='running'"


def _claimer(path: Path, name: str) -> Racer:
    return Racer(path, name, CLAIM, lambda s: s.claim_requests(name, 5, lease_s=60, now=1.0))


async def _one_line(store: SqliteBatchStore) -> None:
    body = {"model": "m", "prompt": "x"}
    await store.create_batch(batch("batch_1", 0.0), [NewRequest(line=1, custom_id="c", body=body)])


def test_two_gateways_racing_for_a_line_claim_it_once_and_neither_fails(tmp_path: Path) -> None:
    path = tmp_path / "batch.sqlite3"
    a, b = _claimer(path, "A"), _claimer(path, "B")
    try:
        asyncio.run(_one_line(a.store))
        race(a, b)
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.result is not None and b.result is not None
        (winner,) = [r for r in (a, b) if r.result]  # the other got nothing
        assert [(c.custom_id, c.attempts) for c in winner.result or []] == [("c", 1)]
        # The store agrees: one claim, by the winner; nothing left to claim.
        with contextlib.closing(sqlite3.connect(str(path))) as db:
            row = db.execute(
                "SELECT claimed_by, attempts FROM batch_requests WHERE custom_id='c'"
            ).fetchone()
        assert row == (winner.name, 1)
        assert asyncio.run(a.store.claim_requests("C", 5, lease_s=60, now=2.0)) == []
    finally:
        a.store.close()
        b.store.close()
