"""A request is billed exactly once, whatever the heartbeats and reclaims did (both stores).

The attack: the gateway's heartbeat waits behind a stall of the store (a slow query in the
SQLite worker's one thread, a held lock, a full PostgreSQL pool) for longer than a gateway
takes to look dead (2.5 heartbeats). Before, its time was taken before it waited, so it
landed stale; the reclaim that followed took the gateway's *own* bookings for a dead
gateway's and expired every one of them — each team's in-flight requests billed `expired`,
their concurrency slots and budget bookings freed under running requests — and when those
requests finished their settlement wrote a second, full usage record beside the `expired`
one (the review's store run: $0.015 `expired` + $0.018 `ok` for one $0.018 request).

Now the heartbeat's time is taken as its row is written, a gateway never reclaims itself,
and a booking that was expired and still settles replaces its `expired` record by its real
one instead of adding one.

Real parts: the real stores (a SQLite file; PostgreSQL from pgserver), the gateway's own
heartbeat (`heartbeat.beat` with its `Books`); the stall is another connection holding the
write lock of the heartbeat's table for longer than the reclaim window, as a long
transaction of another process (a backup, a migration, another gateway's big write) does.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest

from gateway.accounts import heartbeat
from gateway.accounts.ledger import Books
from gateway.accounts.store import open_store
from gateway.accounts.store.base import (
    Booked,
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    Team,
    UsageRecord,
)
from gateway.accounts.store.postgres import PostgresStore
from gateway.accounts.store.sqlite import SqliteStore
from gateway.accounts.usage_writer import UsageWriter
from gateway.config import QuotaConfig
from gateway.metrics import GatewayMetrics
from runtime.tracing import Tracing
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)

HEARTBEAT_S = 0.4
#: longer than a gateway takes to look dead (2.5 heartbeats: 1 s)
STALL_S = 2.0
PROMPT, COMPLETION = 1000, 800
IN_USD, OUT_USD = 5.0, 15.0  # per million tokens


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_db")


@contextlib.contextmanager
def write_lock_held(url: str, seconds: float) -> Iterator[threading.Event]:
    """Another connection holds the heartbeat table's write lock for `seconds` (from a thread);
    the event is set once it holds it."""
    held = threading.Event()

    def sqlite_hold() -> None:
        db = sqlite3.connect(url.removeprefix("sqlite://"), isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        held.set()
        time.sleep(seconds)  # the stall itself: what the test is about
        db.execute("COMMIT")
        db.close()

    def pg_hold() -> None:
        async def hold() -> None:
            con = await asyncpg.connect(url)
            async with con.transaction():
                await con.execute("LOCK TABLE gateways IN EXCLUSIVE MODE")
                held.set()
                await con.execute(f"SELECT pg_sleep({seconds})")
            await con.close()

        asyncio.run(hold())

    t = threading.Thread(target=sqlite_hold if url.startswith("sqlite") else pg_hold)
    t.start()
    try:
        assert held.wait(30), "the lock was never taken"
        yield held
    finally:
        t.join()


def _books(store: Store, gateway_id: str) -> Books:
    metrics = GatewayMetrics()
    quotas = QuotaConfig(reservation_ttl_s=900.0, heartbeat_s=HEARTBEAT_S)
    return Books(store, UsageWriter(store, metrics), metrics, Tracing(), quotas, gateway_id)


def _booked() -> Booked:
    return Booked(
        model="m",
        tier="interactive",
        endpoint="chat",
        prompt_tokens=PROMPT,
        prompt_cost_usd=PROMPT * IN_USD / 1e6,
        completion_usd_per_mtok=OUT_USD,
    )


async def _reserve(store: Store, team: str, rid: str, gateway_id: str) -> Reservation | Refusal:
    return await store.reserve(
        ReserveRequest(
            team_id=team,
            key_id="k",
            request_id=rid,
            tokens=PROMPT + 2000,
            cost_usd=0.05,
            ttl_s=900,
            gateway_id=gateway_id,
            booked=_booked(),
        )
    )


def _settlement(res: Reservation, team: str, rid: str) -> Settlement:
    cost = (PROMPT * IN_USD + COMPLETION * OUT_USD) / 1e6
    record = UsageRecord(
        request_id=rid,
        team_id=team,
        key_id="k",
        model_requested="m",
        model_used="m",
        tier="interactive",
        status="ok",
        prompt_tokens=PROMPT,
        completion_tokens=COMPLETION,
        cost_usd=cost,
        endpoint="chat",
    )
    return Settlement(res.id, record)


def _billed(records: list[UsageRecord]) -> list[tuple[str, str, int, int]]:
    return sorted((r.request_id, r.status, r.prompt_tokens, r.completion_tokens) for r in records)


async def test_a_store_stall_longer_than_the_reclaim_window_bills_each_request_once(
    url: str,
) -> None:
    store = open_store(url)
    await store.open()
    try:
        await store.create_team(Team(id="t", max_concurrent=2, daily_budget_usd=1.0))
        books = _books(store, "gw-live")
        await heartbeat.beat(books)
        t0 = time.time()
        held = [await _reserve(store, "t", f"req-{i}", "gw-live") for i in range(2)]
        assert all(isinstance(r, Reservation) for r in held)
        await heartbeat.beat(books)
        with write_lock_held(url, STALL_S):
            # the heartbeat's turn comes while the store is stalled: it waits the stall out
            await heartbeat.beat(books)
        # the gateway lives and both requests still run: their team's slots stay taken
        third = await _reserve(store, "t", "req-2", "gw-live")
        for i, res in enumerate(held):
            assert isinstance(res, Reservation)
            await store.settle([_settlement(res, "t", f"req-{i}")])
        records = await store.usage_records("t", t0 - 1, time.time() + 1)
        # a third request refused under max_concurrent=2, and one record per request, with its
        # real usage (before: admitted, and an `expired` record beside each request's own)
        assert (third.kind if isinstance(third, Refusal) else "admitted", _billed(records)) == (
            "concurrency",
            [("req-0", "ok", PROMPT, COMPLETION), ("req-1", "ok", PROMPT, COMPLETION)],
        )
        [total] = await store.usage("t", t0 - 1, time.time() + 1, None)
        assert total["cost_usd"] == pytest.approx(
            2 * (PROMPT * IN_USD + COMPLETION * OUT_USD) / 1e6
        )
        # and the team is not locked out: both slots are free again
        assert isinstance(await _reserve(store, "t", "req-3", "gw-live"), Reservation)
    finally:
        await store.close()


async def test_a_reclaimed_booking_that_settles_replaces_its_expired_record(url: str) -> None:
    """A gateway another one took for dead (its bookings reclaimed and billed `expired`) that
    settles after all: its request's real record replaces the `expired` one, and the team's
    spend is the real cost, once."""
    store = open_store(url)
    await store.open()
    try:
        await store.create_team(Team(id="t", daily_budget_usd=1.0))
        t0 = time.time()
        await store.heartbeat("gw-slow", 900, now=t0 - 100)
        res = await _reserve(store, "t", "req-late", "gw-slow")
        assert isinstance(res, Reservation)
        await store.heartbeat("gw-other", 900)
        assert await store.reclaim(10.0) == 1
        [expired] = await store.usage_records("t", t0 - 1, time.time() + 1)
        assert (expired.status, expired.prompt_tokens) == ("expired", PROMPT)
        await store.settle([_settlement(res, "t", "req-late")])
        records = await store.usage_records("t", t0 - 1, time.time() + 1)
        assert _billed(records) == [("req-late", "ok", PROMPT, COMPLETION)]
        [total] = await store.usage("t", t0 - 1, time.time() + 1, None)
        assert total["cost_usd"] == pytest.approx((PROMPT * IN_USD + COMPLETION * OUT_USD) / 1e6)
        # the day's spend the budget reads: the real cost, not the real plus the expired one
        spent = await store.reserve(
            ReserveRequest(
                team_id="t", key_id="k", request_id="r2", tokens=1, cost_usd=0.98, ttl_s=900
            )
        )
        assert isinstance(spent, Reservation), spent  # 0.017 + 0.98 <= 1.0
        # the same settlement again (a retry) still leaves one record
        await store.settle([_settlement(res, "t", "req-late")])
        records = await store.usage_records("t", t0 - 1, time.time() + 1)
        assert _billed(records) == [("req-late", "ok", PROMPT, COMPLETION)]
    finally:
        await store.close()


async def test_a_heartbeat_never_waits_behind_the_stores_queue(url: str) -> None:
    """The store's own queue is busy for `STALL_S` — SQLite's one worker thread running a slow
    call, every connection of PostgreSQL's pool in a slow query — and the heartbeat still lands
    at once, on its own connection: a slow report in this gateway must not make it look dead to
    the others sharing the store."""
    store = open_store(url) if url.startswith("sqlite") else PostgresStore(url, max_connections=2)
    await store.open()
    try:
        await store.heartbeat("gw-busy", 900)
        if isinstance(store, SqliteStore):
            busy = [store._conns.run(lambda db: time.sleep(STALL_S))]  # a slow call on the worker
        else:
            busy = [store.pool.fetchval(f"SELECT pg_sleep({STALL_S})") for _ in range(2)]
        stalls = asyncio.gather(*busy)
        await asyncio.sleep(0.2)  # the slow calls hold the queue (they run for STALL_S)
        t0 = time.monotonic()
        gap = await asyncio.wait_for(store.heartbeat("gw-busy", 900), STALL_S / 2)
        assert gap is not None and time.monotonic() - t0 < STALL_S / 2
        assert await asyncio.wait_for(store.reclaim(60.0, gateway_id="gw-busy"), STALL_S / 2) == 0
        await stalls
    finally:
        await store.close()


async def test_a_settlement_retried_after_it_committed_bills_once(url: str) -> None:
    """The usage writer retries a batch whose commit it did not hear back from (a connection
    lost as PostgreSQL committed): the booking is gone because this very settlement took it, and
    the retry writes nothing more."""
    store = open_store(url)
    await store.open()
    try:
        await store.create_team(Team(id="t"))
        t0 = time.time()
        res = await _reserve(store, "t", "req-once", "gw")
        assert isinstance(res, Reservation)
        s = _settlement(res, "t", "req-once")
        await store.settle([s])
        await store.settle([s])  # the retry: the same settlement, its record's time included
        records = await store.usage_records("t", t0 - 1, time.time() + 1)
        assert _billed(records) == [("req-once", "ok", PROMPT, COMPLETION)]
        [total] = await store.usage("t", t0 - 1, time.time() + 1, None)
        assert total["cost_usd"] == pytest.approx((PROMPT * IN_USD + COMPLETION * OUT_USD) / 1e6)
    finally:
        await store.close()
