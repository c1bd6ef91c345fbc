"""The SQLite store's fast path (gateway/accounts/store/sqlite_conn.py) on a real database file: the
per-request transactions run on the event loop only when they cannot wait — a write lock held
by another connection sends them to the worker thread while the loop keeps running — and the
loop's connection never checkpoints, the worker does, so the WAL stays bounded."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from gateway.accounts.store import sqlite_conn
from gateway.accounts.store.base import Reservation, ReserveRequest, Team
from gateway.accounts.store.sqlite import SqliteStore


def _req(i: int) -> ReserveRequest:
    return ReserveRequest(
        team_id="t", key_id="k", request_id=f"r{i}", tokens=10, cost_usd=0.0, ttl_s=600
    )


async def _store(path: Path) -> SqliteStore:
    s = SqliteStore(path)
    await s.open()
    await s.create_team(Team(id="t", tpm=10_000))
    return s


async def test_a_held_write_lock_sends_the_reservation_to_the_worker_and_the_loop_runs_on(
    tmp_path: Path,
) -> None:
    db_path = tmp_path / "g.db"
    s = await _store(db_path)
    other = sqlite3.connect(
        db_path, isolation_level=None, check_same_thread=False
    )  # another process's writer
    other.execute("BEGIN IMMEDIATE")
    ticks = 0
    longest_gap = 0.0

    async def ticker() -> None:
        nonlocal ticks, longest_gap
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.005)  # the loop's heartbeat: it beats only while the loop is free
            now = time.monotonic()
            ticks, longest_gap, last = ticks + 1, max(longest_gap, now - last), now

    t = asyncio.ensure_future(ticker())
    reserve = asyncio.ensure_future(s.reserve(_req(0)))
    try:
        # the loop is not blocked: the heartbeat goes on while the reservation waits for the lock
        deadline = time.monotonic() + 10
        while ticks < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ticks >= 20 and not reserve.done()
        # A loop waiting on the lock stalls for the whole busy timeout (30 s): far beyond this
        # bound, which only a stall can reach — it measures no speed.
        assert longest_gap < 5.0, (
            f"the event loop stalled {longest_gap:.1f}s waiting for the write lock"
        )
        assert s._conns.busy_fallbacks == 1
        other.execute("COMMIT")
        assert isinstance(await asyncio.wait_for(reserve, 30), Reservation)
    finally:
        t.cancel()
        other.close()
    # the lock is free again: the next reservation takes the fast path
    assert isinstance(await s.reserve(_req(1)), Reservation)
    assert s._conns.busy_fallbacks == 1
    await s.close()


async def test_the_worker_checkpoints_what_the_loop_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sqlite_conn, "CHECKPOINT_EVERY", 50)
    db_path = tmp_path / "g.db"
    s = await _store(db_path)
    for i in range(120):
        assert isinstance(await s.reserve(_req(i)), Reservation)
    # wait for the checkpoints the fast path scheduled on the worker thread
    deadline = time.monotonic() + 30
    while s._conns._checkpoint is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert s._conns._checkpoint is None
    # The database file alone (immutable: the WAL ignored) holds the reservations the
    # checkpoints copied into it — the first 100 at least.
    main_file = sqlite3.connect(f"file:{db_path}?immutable=1", uri=True)
    try:
        (n,) = main_file.execute("SELECT count(*) FROM reservations").fetchone()
    finally:
        main_file.close()
    assert n >= 100
    # and the loop's own connection never checkpoints by itself
    assert s._conns._loop_db.execute("PRAGMA wal_autocheckpoint").fetchone() == (0,)
    await s.close()


async def test_the_wal_stays_bounded_while_the_loop_never_stops_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that runs while the loop goes on writing never catches up with the WAL, and
    SQLite reuses a WAL only once a checkpoint has caught up: with PASSIVE checkpoints alone the
    WAL grew without bound under steady traffic (150 MB after 6,000 writes). Each checkpoint ends
    with a short RESTART, so the next write starts the WAL from its beginning."""
    monkeypatch.setattr(sqlite_conn, "CHECKPOINT_EVERY", 50)
    db_path = tmp_path / "g.db"
    wal = Path(f"{db_path}-wal")
    s = await _store(db_path)
    one_cycle = 0
    for i in range(1000):  # 20 checkpoint cycles of writes, the loop never idle for long
        assert isinstance(await s.reserve(_req(i)), Reservation)
        if i == 45:
            one_cycle = wal.stat().st_size  # what one cycle's writes take in the WAL
        await asyncio.sleep(
            0
        )  # the loop turns (the checkpoint's completion is seen) but never idles
    deadline = time.monotonic() + 30
    while s._conns._checkpoint is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert one_cycle > 0
    assert wal.stat().st_size < 4 * one_cycle, (wal.stat().st_size, one_cycle)
    await s.close()


async def test_a_checkpoint_that_falls_behind_holds_the_loops_writes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WAL bound must not depend on how fast the worker thread is scheduled: on a starved
    machine a checkpoint took as long as several cycles of the loop's writes (the WAL reached
    5.5 cycles' worth in CI). A checkpoint held here on the worker: the loop writes one more
    cycle on its fast path, then its writes wait behind the checkpoint, and go on once it ends."""
    monkeypatch.setattr(sqlite_conn, "CHECKPOINT_EVERY", 20)
    release = threading.Event()
    real_passive = sqlite_conn._passive

    def held_passive(db: sqlite3.Connection) -> None:
        release.wait(30)
        real_passive(db)

    monkeypatch.setattr(sqlite_conn, "_passive", held_passive)
    s = await _store(tmp_path / "g.db")
    for i in range(20):  # the 20th fast write starts the (held) checkpoint
        assert isinstance(await s.reserve(_req(i)), Reservation)
    assert s._conns._checkpoint is not None
    for i in range(20, 40):  # one more cycle goes on the fast path meanwhile
        assert isinstance(await asyncio.wait_for(s.reserve(_req(i)), 10), Reservation)
    assert s._conns.checkpoint_waits == 0
    held = asyncio.ensure_future(s.reserve(_req(40)))
    deadline = time.monotonic() + 10
    while s._conns.checkpoint_waits == 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert s._conns.checkpoint_waits == 1 and not held.done()  # queued behind the checkpoint
    release.set()
    assert isinstance(await asyncio.wait_for(held, 30), Reservation)
    deadline = time.monotonic() + 30
    while s._conns._checkpoint is not None and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert s._conns._checkpoint is None
    waits = s._conns.checkpoint_waits
    assert isinstance(await s.reserve(_req(41)), Reservation)  # the fast path again
    assert s._conns.checkpoint_waits == waits
    await s.close()


async def test_calls_from_another_thread_use_the_worker(tmp_path: Path) -> None:
    """The loop's connection belongs to the loop's thread; a store used from another thread's
    event loop (a CLI helper, a test) still works, through the worker."""
    s = await _store(tmp_path / "g.db")
    out: list[object] = []
    th = threading.Thread(target=lambda: out.append(asyncio.run(s.reserve(_req(0)))))
    th.start()
    th.join(30)
    assert isinstance(out[0], Reservation)
    await s.close()


async def test_a_busy_failure_inside_a_transaction_is_rolled_back_before_the_retry(
    tmp_path: Path,
) -> None:
    """Busy after BEGIN (a COMMIT refused): the loop's transaction is ended, the worker runs the
    call again from the start, and the loop's connection is clean for the next call."""
    s = await _store(tmp_path / "g.db")
    tries: list[str] = []

    def fn(db: sqlite3.Connection) -> int:
        db.execute("BEGIN IMMEDIATE")
        db.execute(
            "INSERT INTO teams (id, default_tier, created_at) VALUES ('x', 'interactive', 0)"
        )
        if not tries:
            tries.append("loop")
            raise sqlite3.OperationalError("database is locked")  # as a refused COMMIT would
        tries.append("worker")
        db.execute("COMMIT")
        return db.execute("SELECT count(*) FROM teams WHERE id = 'x'").fetchone()[0]

    assert await asyncio.wait_for(s._conns.fast(fn), 30) == 1
    assert tries == ["loop", "worker"] and s._conns.busy_fallbacks == 1
    assert not s._conns._loop_db.in_transaction
    assert isinstance(await s.reserve(_req(0)), Reservation)  # the fast path works on
    await s.close()


async def test_settle_now_writes_at_once_or_not_at_all(tmp_path: Path) -> None:
    """The usage writer's batch of one: written before `settle_now` returns when the write lock
    is free; with the lock held elsewhere nothing is written and the caller is told so (it then
    waits on the worker). A record is never written twice."""
    from gateway.accounts.store.base import Settlement, UsageRecord

    db_path = tmp_path / "g.db"
    s = await _store(db_path)

    def settlement(rid: str) -> Settlement:
        return Settlement(
            None,
            UsageRecord(
                request_id=rid,
                team_id="t",
                key_id="k",
                model_requested="m",
                model_used="m",
                tier="interactive",
                status="ok",
                prompt_tokens=3,
            ),
        )

    assert s.settle_now([settlement("a")])
    assert [r.request_id for r in await s.usage_records("t", 0, 1e12)] == ["a"]
    other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")
    try:
        assert not s.settle_now([settlement("b")])
        assert s._conns.busy_fallbacks == 1
    finally:
        other.execute("COMMIT")
        other.close()
    await s.settle([settlement("b")])  # what the caller does next
    assert sorted(r.request_id for r in await s.usage_records("t", 0, 1e12)) == ["a", "b"]
    await s.close()
