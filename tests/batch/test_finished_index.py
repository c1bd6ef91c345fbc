"""The batch tier's throughput estimate (`mean_request_seconds`: the mean run time of the
requests that succeeded since a moment) runs on every `POST /v1/batch` and every simple
status poll. It read every succeeded line the tables held (through the state index: every
line a batch ran well); an index of the lines by state and end reads the recent successes
only. Both stores create it on open, older databases included. Real parts: a SQLite file, a
real PostgreSQL server (pgserver)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import asyncpg

from gateway.accounts.store.postgres_batch import PostgresBatchStore
from gateway.accounts.store.sqlite_batch import SqliteBatchStore

#: mean_request_seconds' query (gateway/accounts/store/*batch_claims.py), for its plan
ESTIMATE = (
    "SELECT AVG(finished_at - started_at) FROM batch_requests "
    "WHERE state='succeeded' AND finished_at>={since}"
)


def _line(n: int, state: str, started: float, finished: float) -> tuple[object, ...]:
    return ("b", f"c{n}", n, "{}", state, started, finished)


_INSERT = (
    "INSERT INTO batch_requests (batch_id, custom_id, line, body, state, started_at, "
    "finished_at) VALUES ({})"
)
LINES = [
    _line(0, "succeeded", 0.0, 10.0),  # before `since`
    _line(1, "succeeded", 100.0, 102.0),
    _line(2, "succeeded", 100.0, 104.0),
    _line(3, "failed", 100.0, 200.0),  # not a success: not in the mean
]


async def test_sqlite_estimates_from_the_index_older_files_too(tmp_path: Path) -> None:
    path = tmp_path / "batch.sqlite3"
    s = SqliteBatchStore(path)
    assert await s.mean_request_seconds(0) is None  # opens (creates) the file
    s.close()
    with sqlite3.connect(path) as db:  # a file from before the index, with some lines
        db.execute("DROP INDEX batch_requests_finished")
        db.executemany(_INSERT.format(",".join("?" * 7)), LINES)
    s = SqliteBatchStore(path)
    try:
        assert await s.mean_request_seconds(50.0) == 3.0
    finally:
        s.close()
    with sqlite3.connect(path) as db:
        plan = " ".join(
            r[-1] for r in db.execute("EXPLAIN QUERY PLAN " + ESTIMATE.format(since="?"), (50,))
        )
    assert "batch_requests_finished" in plan and "SCAN batch_requests" not in plan, plan


async def test_postgres_gains_the_index(postgres_db: str) -> None:
    s = PostgresBatchStore(postgres_db)
    assert await s.mean_request_seconds(0) is None
    s.close()
    con = await asyncpg.connect(postgres_db)
    try:
        await con.execute("DROP INDEX batch_requests_finished")
        await con.executemany(_INSERT.format("$1,$2,$3,$4,$5,$6,$7"), LINES)
        s = PostgresBatchStore(postgres_db)
        try:
            assert await s.mean_request_seconds(50.0) == 3.0
        finally:
            s.close()
        assert await con.fetchval("SELECT to_regclass('batch_requests_finished')") is not None
        await con.execute("SET enable_seqscan = off")  # a table this small is read whole anyway
        plan = await con.fetch("EXPLAIN " + ESTIMATE.format(since="50"))
        assert "batch_requests_finished" in " ".join(r[0] for r in plan), plan
    finally:
        await con.execute("DELETE FROM batch_requests WHERE batch_id='b'")
        await con.close()
