"""The SQLite store's two connections: a worker thread for anything that may wait, and a
fast path on the event loop's own thread for the short transactions every request makes.

Every request books a reservation before its first token and commits its usage record before
its last chunk. On the worker thread each of those paid two thread switches (queue the call,
wake the loop with the answer) — on a busy 2-core machine that was most of the gateway's
overhead and nearly all of its tail. `fast()` runs them on the loop thread instead, but only
when that cannot wait:

- the loop's connection has `busy_timeout = 0`: when another connection (this process's
  worker thread, the CLI, another gateway on the same file) holds the write lock,
  `BEGIN IMMEDIATE` fails at once and the call goes to the worker thread, which waits for the
  lock there (`busy_timeout` 30 s), never on the loop;
- it never checkpoints (`wal_autocheckpoint = 0`): a checkpoint fsyncs. Every
  `CHECKPOINT_EVERY` fast commits a checkpoint runs on the worker thread (one at a time;
  `_checkpoint_cycle` says how), so the WAL file stays bounded. The bound does not depend on
  how fast the worker thread is scheduled: once another `CHECKPOINT_EVERY` fast writes have
  happened while a checkpoint still runs, the loop's writes go to the worker, queued behind
  it, until it ends (on a starved 2-core machine the WAL had grown to 5.5 cycles' worth);
- in WAL mode with `synchronous = NORMAL` a commit writes WAL frames to the page cache and
  does not fsync: that is what the loop may do, and the durability is the worker's (survives a
  killed process, as before).

The gateway's heartbeat (and its reclaim of dead gateways) has a lane of its own, a second
thread with its own connection (`beat`): behind a slow call on the worker (a big usage report,
a checkpoint) it would wait, and a heartbeat that cannot land makes this gateway look dead to
every other gateway on the file. The lane still waits for the write lock like any writer, but
never behind this process's queue.

Usage reports (`/v1/usage` and its admin pages) have a lane of their own too, a third thread
with a read-only connection (`report`): on the worker, a report over many rows held up every
write queued behind it — settlements, team changes, the reservations the fast path hands
over, and the checkpoint, after which all reservations queue. In WAL mode a reader neither
waits for writers nor holds them up (only a checkpoint's RESTART waits, `RESTART_WAIT_MS` at
most, for a reader).

A callable given to `fast()` must be safe to run twice: a busy failure happens at
`BEGIN IMMEDIATE`, before any effect, or rolls its transaction back (`_tx`), and the worker
runs it again from the start. `Immediate` is the write transaction every such callable opens.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from gateway.accounts.store.private_files import private_dir, private_file

log = logging.getLogger("duet.gateway.store")
T = TypeVar("T")

#: fast-path commits between two checkpoints on the worker thread (~12 MB of WAL at most)
CHECKPOINT_EVERY = 500
#: how long a checkpoint's RESTART waits for another connection's readers, writers held off
RESTART_WAIT_MS = 50


def connect(
    path: Path, busy_timeout_ms: int, set_wal: bool, read_only: bool = False
) -> sqlite3.Connection:
    db = sqlite3.connect(
        path.resolve().as_uri() + "?mode=ro" if read_only else path,
        isolation_level=None,
        timeout=busy_timeout_ms / 1000,
        check_same_thread=False,
        uri=read_only,
    )
    if set_wal:  # persistent in the file: the worker sets it once, waiting for locks as it may
        _set_wal(db, busy_timeout_ms)
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute(f"PRAGMA busy_timeout={busy_timeout_ms}")
    return db


def _set_wal(db: sqlite3.Connection, busy_timeout_ms: int) -> None:
    """Switch the file to WAL, retrying while it is locked: SQLite answers "database is locked"
    at once, not through the busy handler, when other connections to a new file (gateways
    starting together, or this store's own report lane) hold a lock the switch needs."""
    deadline = time.monotonic() + busy_timeout_ms / 1000
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if not _busy(e) or time.monotonic() > deadline:
                raise
        time.sleep(0.01)  # a worker thread's wait, as the busy handler's own


def _busy(e: sqlite3.OperationalError) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)
    return "locked" in str(e) or "busy" in str(e)


class Connections:
    """One SQLite file's connections: the worker thread's (opened on its first call, on that
    thread, with `init` run there first: the schema) and, once `open` ran, the loop's fast path.
    A file only the worker uses (the batch tables) needs no `open`: its first call opens it."""

    def __init__(self, path: Path, init: Callable[[sqlite3.Connection], None]) -> None:
        self.path = path
        self._init = init
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duet-store")
        self._worker: sqlite3.Connection | None = None
        #: the heartbeat's lane: its own thread and connection (`beat`)
        self._beat_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duet-store-beat")
        self._beat: sqlite3.Connection | None = None
        #: usage reports' lane: its own thread and read-only connection (`report`)
        self._report_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="duet-store-rep")
        self._report: sqlite3.Connection | None = None
        self._loop_db: sqlite3.Connection | None = None
        self._loop_thread: int | None = None
        self._since_checkpoint = 0
        self._checkpoint: asyncio.Future[None] | None = None
        #: a checkpoint's RESTART is running: the loop's writes wait behind it on the worker
        self._restarting = False
        #: calls the fast path handed to the worker because the write lock was taken
        self.busy_fallbacks = 0
        #: calls the fast path handed to the worker because a checkpoint fell behind the writes
        self.checkpoint_waits = 0

    def _worker_db(self) -> sqlite3.Connection:
        """The worker thread's connection (on the worker thread: it opens it the first time)."""
        if self._worker is None:
            private_file(private_dir(self.path.parent) / self.path.name)
            db = connect(self.path, 30_000, set_wal=True)
            self._init(db)
            for suffix in (
                "-wal",
                "-shm",
            ):  # SQLite gives them the database's mode; an old file's too
                side = self.path.with_name(self.path.name + suffix)
                if side.exists():
                    private_file(side)
            self._worker = db
        return self._worker

    def _beat_db(self) -> sqlite3.Connection:
        """The heartbeat lane's connection (on its thread; the worker made the schema)."""
        if self._beat is None:
            self._beat = connect(self.path, 30_000, set_wal=False)
        return self._beat

    def _report_db(self) -> sqlite3.Connection:
        """The reports lane's connection (on its thread; read-only: a report cannot write)."""
        if self._report is None:
            self._report = connect(self.path, 30_000, set_wal=False, read_only=True)
        return self._report

    async def open(self) -> None:
        """Open the worker's connection, the heartbeat lane's and the loop's fast path (on this
        loop's thread)."""
        await self.run(lambda db: None)
        await self.beat(lambda db: None)
        db = connect(self.path, 0, set_wal=False)
        db.execute("PRAGMA wal_autocheckpoint=0")
        self._loop_db, self._loop_thread = db, threading.get_ident()

    async def close(self) -> None:
        if self._checkpoint is not None:
            await asyncio.gather(self._checkpoint, return_exceptions=True)
        if self._loop_db is not None:
            self._loop_db.close()
            self._loop_db = None
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._pool, self._close_worker)
        await loop.run_in_executor(self._beat_pool, self._close_beat)
        await loop.run_in_executor(self._report_pool, self._close_report)
        self._pool.shutdown(wait=True)
        self._beat_pool.shutdown(wait=True)
        self._report_pool.shutdown(wait=True)

    def close_now(self) -> None:
        """`close` from outside any event loop (a file only the worker used)."""
        self._pool.submit(self._close_worker).result()
        self._report_pool.submit(self._close_report).result()
        self._pool.shutdown(wait=True)
        self._beat_pool.shutdown(wait=True)
        self._report_pool.shutdown(wait=True)

    def _close_worker(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def _close_beat(self) -> None:
        if self._beat is not None:
            self._beat.close()
            self._beat = None

    def _close_report(self) -> None:
        if self._report is not None:
            self._report.close()
            self._report = None

    async def run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` on the worker thread (it may wait for the write lock)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, lambda: fn(self._worker_db())
        )

    async def beat(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` on the heartbeat's own thread and connection (it may wait for the write lock,
        never behind the worker's queue)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._beat_pool, lambda: fn(self._beat_db())
        )

    async def report(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` in one read transaction on the reports lane (its own thread and read-only
        connection): a long usage report never queues ahead of the worker's writes."""
        return await asyncio.get_running_loop().run_in_executor(
            self._report_pool, lambda: _in_tx(self._report_db(), "BEGIN", fn)
        )

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` in one `BEGIN IMMEDIATE` transaction on the worker: the write lock is held from
        its first read on, so no other connection writes between what it reads and writes."""
        return await self.run(lambda db: _in_tx(db, "BEGIN IMMEDIATE", fn))

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` in one deferred transaction on the worker (in WAL mode a read never waits)."""
        return await self.run(lambda db: _in_tx(db, "BEGIN", fn))

    async def fast(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """`fn` on the loop thread when the write lock is free now, else on the worker."""
        done, out = self.now(fn)
        return out if done else await self.run(fn)  # type: ignore[return-value]  # done: out is a T

    def now(self, fn: Callable[[sqlite3.Connection], T]) -> tuple[bool, T | None]:
        """`(True, fn(db))` on the loop's connection if the write lock is free at this moment;
        `(False, None)` when it is not, or off the loop thread (nothing was done: `fn`'s
        transaction failed at `BEGIN` or was rolled back)."""
        db = self._loop_db
        if db is None or self._restarting or threading.get_ident() != self._loop_thread:
            return False, None
        if self._checkpoint is not None and self._since_checkpoint >= CHECKPOINT_EVERY:
            # A checkpoint slower than the loop's writes: they wait for it on the worker (FIFO
            # behind it) rather than grow the WAL without bound. A read would not grow it, but
            # which calls write is known only afterwards: all wait, for one checkpoint's time.
            self.checkpoint_waits += 1
            return False, None
        changes = db.total_changes
        try:
            out = fn(db)
        except sqlite3.OperationalError as e:
            if not _busy(e):
                raise
            if db.in_transaction:  # busy past BEGIN (at COMMIT): end it, or it holds the lock
                db.execute("ROLLBACK")
            self.busy_fallbacks += 1
            return False, None
        if db.total_changes != changes:  # a write (a key lookup adds nothing to the WAL)
            self._since_checkpoint += 1
        if self._since_checkpoint >= CHECKPOINT_EVERY and self._checkpoint is None:
            self._since_checkpoint = 0
            self._checkpoint = asyncio.ensure_future(self._checkpoint_cycle())
            self._checkpoint.add_done_callback(self._checkpoint_done)
        return True, out

    async def _checkpoint_cycle(self) -> None:
        """PASSIVE copies the WAL into the database while the loop goes on writing: the bulk of
        the work, and no writer waits for it. It cannot catch up with a loop that keeps writing,
        though, and SQLite reuses a WAL only after a checkpoint has caught up: with PASSIVE
        alone the WAL grew without bound under steady traffic (150 MB after 6,000 writes). So a
        RESTART follows, which copies the few frames written meanwhile and leaves the WAL to be
        started again from its beginning. It needs the write lock: the loop's own writes go to
        the worker meanwhile, queued behind it (a millisecond or two), so the loop cannot starve
        it of the lock."""
        await self.run(_passive)
        self._restarting = True
        try:
            await self.run(_restart)
        finally:
            self._restarting = False

    def _checkpoint_done(self, fut: asyncio.Future[None]) -> None:
        self._checkpoint = None
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("WAL checkpoint failed: %s", fut.exception())


def _passive(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()


def _restart(db: sqlite3.Connection) -> None:
    """Waits at most RESTART_WAIT_MS for another connection's reader or writer (a usage report,
    another process) — the loop's writes must not wait behind one — and otherwise leaves the
    restart to the next checkpoint."""
    (timeout_ms,) = db.execute("PRAGMA busy_timeout").fetchone()
    db.execute(f"PRAGMA busy_timeout={RESTART_WAIT_MS}")
    try:
        db.execute("PRAGMA wal_checkpoint(RESTART)").fetchall()
    finally:
        db.execute(f"PRAGMA busy_timeout={timeout_ms}")


def _in_tx(db: sqlite3.Connection, begin: str, fn: Callable[[sqlite3.Connection], T]) -> T:
    db.execute(begin)
    try:
        out = fn(db)
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return out


class Immediate:
    """BEGIN IMMEDIATE … COMMIT, ROLLBACK on error (autocommit connection)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
