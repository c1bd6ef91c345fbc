"""A batch's request counts are columns of its row, kept as its lines finish: getting or
listing batches reads no line (a listing of 100 batches of 50,000 lines counted 5 million rows
per call), and the counts outlive the lines (the store drops an ended batch's lines). A table
from before the columns gains them on open, counted once from its lines, and loses the lines of
its ended batches. Both stores: a SQLite file and a real PostgreSQL (pgserver)."""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gateway.accounts.store.postgres_batch import PostgresBatchStore
from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.models import RequestCounts
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch

#: runs one SQL statement on the store's database, beside the store: its first value, if any
Raw = Callable[[str], Awaitable[Any]]


@pytest.fixture(params=["sqlite", "postgres"])
def store_and_sql(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, Raw]:
    if request.param == "sqlite":
        path = tmp_path / "batch.sqlite3"

        async def sqlite_raw(sql: str) -> Any:
            with sqlite3.connect(path) as db:
                row = db.execute(sql).fetchone()
            return None if row is None else row[0]

        return lambda: SqliteBatchStore(path), sqlite_raw
    dsn = request.getfixturevalue("postgres_db")

    async def pg_raw(sql: str) -> Any:
        con = await asyncpg.connect(dsn)
        try:
            return await con.fetchval(sql)
        finally:
            await con.close()

    return lambda: PostgresBatchStore(dsn), pg_raw


async def _ran(s: Any) -> None:
    """batch_1 of 3 lines: 2 succeeded, 1 failed."""
    reqs = [NewRequest(line=i + 1, custom_id=f"c{i}", body="{}") for i in range(3)]
    await s.create_batch(batch("batch_1", 0.0), reqs)
    for i, c in enumerate(await s.claim_requests("A", 3, lease_s=10, now=1.0)):
        kw = {"status_code": 200, "request_id": "r", "response": {}, "error": None, "now": 2.0}
        assert await s.finish_request("A", "batch_1", c.custom_id, ok=i < 2, **kw)


COUNTS = RequestCounts(total=3, completed=2, failed=1)


async def test_counts_are_the_rows_own(store_and_sql: tuple[Any, Raw]) -> None:
    open_store, sql = store_and_sql
    s = open_store()
    try:
        await _ran(s)
        await sql("DELETE FROM batch_requests WHERE batch_id='batch_1'")
        assert (await s.get_batch("t", "batch_1")).counts == COUNTS
        listed, _ = await s.list_batches("t", None, 10)
        assert [b.counts for b in listed] == [COUNTS]
    finally:
        s.close()


async def test_an_older_table_gains_its_counts(store_and_sql: tuple[Any, Raw]) -> None:
    open_store, sql = store_and_sql
    s = open_store()
    try:
        await _ran(s)
    finally:
        s.close()
    await sql("ALTER TABLE batches DROP COLUMN n_succeeded")
    await sql("ALTER TABLE batches DROP COLUMN n_failed")
    await sql("UPDATE batches SET status='completed'")  # ended before its lines were dropped
    s = open_store()
    try:
        assert (await s.get_batch("t", "batch_1")).counts == COUNTS
        assert await sql("SELECT COUNT(*) FROM batch_requests") == 0
    finally:
        s.close()


async def test_an_ended_batch_leaves_no_lines(store_and_sql: tuple[Any, Raw]) -> None:
    open_store, sql = store_and_sql
    s = open_store()
    try:
        await _ran(s)
        await s.create_batch(batch("batch_2", 0.0), [NewRequest(line=1, custom_id="x", body="{}")])
        assert await s.claim_finalizable("A", 10, now=3.0) == ["batch_1"]
        assert await s.finish_batch("A", "batch_1", "completed", [], None, None, 3.0)
        assert await sql("SELECT COUNT(*) FROM batch_requests WHERE batch_id='batch_1'") == 0
        assert await sql("SELECT COUNT(*) FROM batch_requests") == 1  # batch_2's, still open
        assert (await s.get_batch("t", "batch_1")).counts == COUNTS
    finally:
        s.close()


async def test_queued_lines_are_counted_from_the_batches(store_and_sql: tuple[Any, Raw]) -> None:
    open_store, sql = store_and_sql
    s = open_store()
    try:
        await _ran(s)  # all 3 lines have an outcome
        reqs = [NewRequest(line=i + 1, custom_id=f"d{i}", body="{}") for i in range(4)]
        await s.create_batch(batch("batch_2", 0.0), reqs)
        [c] = await s.claim_requests("A", 1, lease_s=10, now=3.0)
        kw = {"status_code": 200, "request_id": "r", "response": {}, "error": None, "now": 4.0}
        assert await s.finish_request("A", "batch_2", c.custom_id, ok=True, **kw)
        await sql("DELETE FROM batch_requests")  # read no line
        assert await s.pending_requests() == 3
    finally:
        s.close()
