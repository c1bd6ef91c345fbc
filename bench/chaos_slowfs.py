"""The `slowfs` fault of `duet bench chaos`: the gateways' store slow to commit, as on a disk
whose fsync takes seconds.

A SQLite commit holds the database's write lock until its sync returns, so behind a slow fsync
every other write — a reservation, a usage record, a heartbeat, a batch claim — waits for the
lock, while reads go on (WAL). This VM kind has neither device-mapper's `delay` target nor a FUSE
library, so the slow commit is made the way another process would make it: a connection of this
one takes the store's write lock (`BEGIN IMMEDIATE`), keeps it `commit_s`, lets go for `GAP_S`,
and again, until the fault ends. Every gateway write then waits up to `commit_s` per turn; what
the fault must show is that every request is still answered and billed once, and no team or
gateway is locked out once it ends.

Invariant: `stop()` returns once the lock is released; the holder never writes a row.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from pathlib import Path

#: the time the lock is free between two slow commits (the gateways' writes get in then)
GAP_S = 0.1


class SlowStore:
    def __init__(self, db: Path, commit_s: float) -> None:
        if not db.is_file():
            raise RuntimeError(f"the slowfs fault needs duet up's SQLite store; no {db}")
        self.db, self.commit_s = db, commit_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="chaos-slowfs", daemon=True)
        #: slow commits made so far
        self.commits = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _hold(self) -> None:
        conn = sqlite3.connect(self.db, isolation_level=None, timeout=30)
        try:
            while not self._stop.is_set():
                with contextlib.suppress(sqlite3.OperationalError):  # busy past 30 s: try again
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        self._stop.wait(self.commit_s)  # the slow sync, lock held
                    finally:
                        conn.execute("ROLLBACK")
                    self.commits += 1
                self._stop.wait(GAP_S)
        finally:
            conn.close()
