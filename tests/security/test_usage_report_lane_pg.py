"""A usage report never holds a connection the PostgreSQL store's bookings need.

Reports (`/v1/usage` by totals, by record, the outliers) ran on the store's one pool, beside
every reservation and settlement of every team: a few slow reports at once held all of its
connections and every team's requests waited for one. They now run on a small read-only pool of
their own (REPORT_CONNECTIONS).

Real parts: a PostgreSQL server (pgserver). A second connection locks the usage table, so every
report blocks in the server at its first read — "the reports are running" is a fact the test
reads from pg_stat_activity on a third connection, not a race — while more reports than the
main pool has connections are in flight; a reservation must go through meanwhile.
"""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import Reservation, ReserveRequest, Team
from gateway.accounts.store.postgres import REPORT_CONNECTIONS, PostgresStore
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.wait import until

WITHIN_S = 10.0
BLOCKED = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
    "AND wait_event_type = 'Lock'"
)


@pytest.mark.parametrize("report", ["totals", "records", "outliers"])
async def test_reports_blocked_in_the_server_leave_bookings_their_connections(
    postgres_db: str,  # noqa: F811  (the fixture imported above)
    report: str,
) -> None:
    store = open_store(postgres_db)
    assert isinstance(store, PostgresStore)
    store.max_connections = 4
    await store.open()
    lock = await asyncpg.connect(postgres_db)
    watch = await asyncpg.connect(postgres_db)
    pending: list[asyncio.Future[object]] = []
    try:
        await store.create_team(Team(id="big"))
        await store.create_team(Team(id="victim"))
        tx = lock.transaction()
        await tx.start()
        await lock.execute("LOCK TABLE usage IN ACCESS EXCLUSIVE MODE")
        run = {
            "totals": lambda: store.usage("big", 0, 2e9, "model"),
            "records": lambda: store.usage_records("big", 0, 2e9, limit=1000),
            "outliers": lambda: store.usage_outliers("big", 0, 2e9, 10),
        }[report]
        # more reports than the main pool has connections
        pending = [asyncio.ensure_future(run()) for _ in range(store.max_connections + 2)]

        async def blocked() -> bool:
            # read outside the lock's transaction: a transaction keeps its first snapshot of
            # pg_stat_activity
            return int(await watch.fetchval(BLOCKED)) >= REPORT_CONNECTIONS

        await until(blocked, WITHIN_S, "the reports to block on the usage table")
        booked = await asyncio.wait_for(
            store.reserve(
                ReserveRequest(
                    team_id="victim", key_id="k", request_id="r", tokens=10, cost_usd=0.0, ttl_s=60
                )
            ),
            WITHIN_S,
        )
        assert isinstance(booked, Reservation)
        assert not any(p.done() for p in pending), "the reports are still held in the server"
        await tx.rollback()
        assert await asyncio.wait_for(asyncio.gather(*pending), WITHIN_S) == [[]] * len(pending)
    finally:
        for p in pending:
            p.cancel()
        await lock.close()
        await watch.close()
        await store.close()
