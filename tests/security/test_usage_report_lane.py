"""A usage report never queues ahead of the SQLite store's writes.

Reports (`/v1/usage`, by totals, by record, the outliers) ran on the store's one worker thread,
first come first served with settlements, team changes, the reservations the fast path hands
over and the WAL checkpoint: a report over a large table held all of them up, and past a
checkpoint every reservation of every team queued behind it. They now run on a lane of their
own (a thread and a read-only connection).

Real parts: an SQLite store on a file. Each connection is traced; a statement reading the usage
table waits at its start until the test lets it go, so "a report is running" is a fact, not a
race: the worker's writes must complete meanwhile.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gateway.accounts.store import open_store, sqlite_conn
from gateway.accounts.store.base import Store, Team
from tests.wait import until

WITHIN_S = 10.0


class HeldReports:
    """Holds every statement that reads the usage table, on whatever thread runs it."""

    def __init__(self) -> None:
        self.armed = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def trace(self, sql: str) -> None:
        head = sql.lstrip().upper()
        if self.armed and head.startswith(("SELECT", "WITH")) and "FROM USAGE" in head:
            self.entered.set()
            self.release.wait(60)


@pytest.fixture
async def held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Store, HeldReports]]:
    reports = HeldReports()
    plain = sqlite_conn.connect

    def traced(*args: object, **kwargs: object) -> sqlite3.Connection:
        db = plain(*args, **kwargs)  # type: ignore[arg-type]
        db.set_trace_callback(reports.trace)
        return db

    monkeypatch.setattr(sqlite_conn, "connect", traced)
    store = open_store(f"sqlite://{tmp_path / 'g.db'}")
    await store.open()
    await store.create_team(Team(id="big"))
    try:
        yield store, reports
    finally:
        reports.release.set()
        await store.close()


@pytest.mark.parametrize("report", ["totals", "records", "outliers"])
async def test_a_running_report_does_not_hold_up_the_worker(
    held: tuple[Store, HeldReports], report: str
) -> None:
    store, reports = held
    reports.armed = True
    run = {
        "totals": lambda: store.usage("big", 0, 2e9, "model"),
        "records": lambda: store.usage_records("big", 0, 2e9, limit=1000),
        "outliers": lambda: store.usage_outliers("big", 0, 2e9, 10),
    }[report]
    pending = asyncio.ensure_future(run())
    await until(reports.entered.is_set, WITHIN_S, "the report to start")
    # the worker's own calls: a team change, the expiry sweep
    await asyncio.wait_for(store.create_team(Team(id="victim")), WITHIN_S)
    await asyncio.wait_for(store.expire_reservations(), WITHIN_S)
    assert not pending.done(), "the report is still held: the writes did not wait for it"
    reports.release.set()
    assert await asyncio.wait_for(pending, WITHIN_S) == []
