"""Why the SQLite batch store's writes begin with `BEGIN IMMEDIATE`
(gateway/accounts/store/sqlite_conn.py `Connections.write`): two gateways (or two workers) on
one database file claim batch lines, each claim a read of the claimable lines and then a write
of the claim, in one transaction. Under a plain (deferred) `BEGIN` the second claim can read
while the first is between its read and its write; the first commits, and the second's write
then finds its snapshot stale: SQLite refuses it (`database is locked`, at once: a busy timeout
cannot help a stale snapshot) and that runner's claim fails. `BEGIN IMMEDIATE` takes the write
lock before the read: the second claim waits for the first, then reads what it left.

The test builds exactly that interleaving, whatever the order the threads run in: each store's
connection is traced, and the claim that reaches its write first waits there until the other
claim has read too (deferred), or has begun its transaction and cannot read because the
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
import threading
from pathlib import Path

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import Claimed, NewRequest
from tests.batch.test_store import batch
from tests.wait import wait_for

WITHIN_S = 30.0
CLAIM = "UPDATE batch_requests SET state='running'"


class Racer:
    """One gateway: a store on the shared file, and where its claim's transaction has got to."""

    def __init__(self, path: Path, name: str) -> None:
        self.name = name
        self.store = SqliteBatchStore(path)
        self.began = threading.Event()  # its BEGIN has started (it may be waiting for the lock)
        self.read = threading.Event()  # its read is done: it is about to write its claim
        self.other: Racer | None = None
        self.got: list[Claimed] | None = None
        self.error: BaseException | None = None
        # the store's connection lives on its worker thread: trace it there
        asyncio.run(self.store._batch.run(lambda db: db.set_trace_callback(self._trace)))

    def _trace(self, sql: str) -> None:
        # Called as each statement starts, on the thread running the transaction.
        if sql.startswith("BEGIN"):
            self.began.set()
        elif sql.startswith(CLAIM) and not self.read.is_set():
            self.read.set()
            other = self.other
            assert other is not None
            # Hold this claim between its read and its write until the other one has read
            # too, or cannot read before this one commits. (sqlite3 drops what a trace
            # callback raises: a wait that timed out is kept for the test to report.)
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

    def claim(self, start: threading.Barrier) -> None:
        start.wait(WITHIN_S)
        try:
            self.got = asyncio.run(self.store.claim_requests(self.name, 5, lease_s=60, now=1.0))
        except BaseException as e:  # what the test reports: a claim that failed
            self.error = self.error or e


def write_locked(path: Path) -> bool:
    """Whether some connection holds the database's write lock (a third connection asks)."""
    probe = sqlite3.connect(str(path), timeout=0, isolation_level=None)
    try:
        probe.execute("BEGIN IMMEDIATE")
        probe.execute("ROLLBACK")
        return False
    except sqlite3.OperationalError as e:
        assert "locked" in str(e), e
        return True
    finally:
        probe.close()


async def _one_line(store: SqliteBatchStore) -> None:
    body = {"model": "m", "prompt": "x"}
    await store.create_batch(batch("batch_1", 0.0), [NewRequest(line=1, custom_id="c", body=body)])


def test_two_gateways_racing_for_a_line_claim_it_once_and_neither_fails(tmp_path: Path) -> None:
    path = tmp_path / "batch.sqlite3"
    a, b = Racer(path, "A"), Racer(path, "B")
    a.other, b.other = b, a
    try:
        asyncio.run(_one_line(a.store))
        start = threading.Barrier(2)
        threads = [threading.Thread(target=r.claim, args=(start,)) for r in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(2 * WITHIN_S)
        assert not any(t.is_alive() for t in threads)
        assert a.error is None and b.error is None, (a.error, b.error)
        assert a.got is not None and b.got is not None
        (winner,) = [r for r in (a, b) if r.got]  # the other got nothing
        assert [(c.custom_id, c.attempts) for c in winner.got or []] == [("c", 1)]
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
