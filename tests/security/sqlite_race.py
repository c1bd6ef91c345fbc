"""Two gateways' SQLite batch stores on one file, one operation each, interleaved on purpose
(tests/security/test_batch_store_immediate.py, test_batch_cancel_race.py): each store's
connection is traced, and the operation that reaches its write first waits there until the other
has read too (a deferred `BEGIN`), or has begun its `BEGIN IMMEDIATE` and cannot read because
the database is write-locked — the interleaving is built whatever the order the threads run in.
A third connection only probes the write lock.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from tests.wait import wait_for

WITHIN_S = 30.0


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


class Racer:
    """One gateway's store and one operation on it, held between its read and its write (the
    statement that starts with `write`)."""

    def __init__(
        self, path: Path, name: str, write: str, op: Callable[[SqliteBatchStore], Awaitable[Any]]
    ) -> None:
        self.name, self.write, self.op = name, write, op
        self.store = SqliteBatchStore(path)
        self.began = threading.Event()  # its BEGIN IMMEDIATE started (it may wait for the lock)
        self.read = threading.Event()  # its read is done: it is about to write
        self.other: Racer | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        # the store's connection lives on its worker thread: trace it there
        asyncio.run(self.store._batch.run(lambda db: db.set_trace_callback(self._trace)))

    def _trace(self, sql: str) -> None:
        # Called as each statement starts, on the thread running the transaction. Only an
        # immediate BEGIN may wait for the lock; a deferred one always goes on to read.
        if sql.startswith("BEGIN IMMEDIATE"):
            self.began.set()
        elif sql.startswith(self.write) and not self.read.is_set():
            self.read.set()
            other = self.other
            assert other is not None
            # (sqlite3 drops what a trace callback raises: a wait that timed out is kept for
            # the test to report)
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


def race(a: Racer, b: Racer) -> None:
    """Run both operations at once, each on its own thread, and wait for both."""
    a.other, b.other = b, a
    start = threading.Barrier(2)
    threads = [threading.Thread(target=r.run, args=(start,)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * WITHIN_S)
    assert not any(t.is_alive() for t in threads)
