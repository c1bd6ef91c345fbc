"""The claim reads only what it needs (gateway/accounts/store/claim_order.py): a team's first n
candidates per claim, each batch's a range of an index, where it ranked every claimable line of
every open batch. Its answer must not change: on a randomized store (several teams, batches of
several priorities, lines pending, pending not yet due, running under a live or a lapsed lease,
finished, some batches past their window or no longer in progress) every claim takes exactly
the lines the earlier query picks (bench.batch_claims.OLD_PICK, the bench's baseline, is the
oracle), through many claims of various sizes as the clock moves and lines finish. Both stores:
a SQLite file and a real PostgreSQL server (pgserver). And on SQLite, every query the claim
makes reads through an index."""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from bench.batch_claims import OLD_PICK
from gateway.accounts.store import claim_order
from gateway.accounts.store.sqlite_batch import SqliteBatchStore
from gateway.batch.rows import NewRequest
from tests.batch.test_store import batch

#: a line's state, as the randomized store sets it: (state, not_before, lease, started, finished)
#: relative to the clock at setup
SHAPES = [
    ("pending", None, None, None, None),
    ("pending", 30.0, None, -5.0, None),  # a retry not yet due
    ("running", None, 40.0, -3.0, None),  # live lease
    ("running", None, -1.0, -20.0, None),  # lapsed lease
    ("succeeded", None, None, -30.0, -25.0),
    ("failed", None, None, -12.0, -11.0),
]
_SET = (
    "UPDATE batch_requests SET state=?, not_before=COALESCE(?, not_before), lease_until=?, "
    "started_at=?, finished_at=?, claimed_by=? WHERE batch_id=? AND custom_id=?"
)


def _pg(sql: str) -> str:
    """A '?' query in PostgreSQL's numbered placeholders."""
    n = iter(range(1, 100))
    return re.sub(r"\?", lambda _m: f"${next(n)}", sql)


class Db:
    """The same database as the store's, for setup and the oracle: SQLite or PostgreSQL."""

    def __init__(self, sqlite: sqlite3.Connection | None, pg: Any = None) -> None:
        self.sqlite, self.pg = sqlite, pg

    async def run(self, sql: str, *args: Any) -> list[tuple[Any, ...]]:
        if self.sqlite is not None:
            with self.sqlite:
                return [tuple(r) for r in self.sqlite.execute(sql, args).fetchall()]
        return [tuple(r) for r in await self.pg.fetch(_pg(sql), *args)]


async def _populate(store: Any, db: Db, rng: random.Random, now: float) -> None:
    """Teams t0..t3, a dozen batches of 0..25 lines, each line in a random shape."""
    for b in range(12):
        row = replace(
            batch(f"batch_{b}", now - 50, window=rng.choice([100.0, 100.0, 100.0, 40.0])),
            team_id=f"t{rng.randrange(4)}",
            priority=rng.choice([0, 1, 1, 2]),
        )
        reqs = [
            NewRequest(line=i + 1, custom_id=f"c{i}", body={"prompt": "x"})
            for i in range(rng.randrange(26))
        ]
        await store.create_batch(row, reqs)
        for i in range(len(reqs)):
            state, nb, lease, started, fin = rng.choice(SHAPES)
            await db.run(
                _SET,
                state,
                None if nb is None else now + nb,
                None if lease is None else now + lease,
                None if started is None else now + started,
                None if fin is None else now + fin,
                "W0" if state == "running" else None,
                f"batch_{b}",
                f"c{i}",
            )
        status = rng.choice(["in_progress"] * 4 + ["cancelling", "completed"])
        await db.run("UPDATE batches SET status=? WHERE id=?", status, f"batch_{b}")


async def _churn(store: Any, db: Db, rng: random.Random, now: float) -> None:
    """Some running lines finish or go back for a retry, as runners would."""
    running = await db.run(
        "SELECT batch_id, custom_id, claimed_by FROM batch_requests WHERE state='running' "
        "ORDER BY batch_id, custom_id"
    )
    for bid, cid, worker in running:
        roll = rng.random()
        if roll < 0.3:
            await store.finish_request(
                worker,
                bid,
                cid,
                ok=rng.random() < 0.8,
                status_code=200,
                request_id=None,
                response={"ok": True},
                error=None,
                now=now,
            )
        elif roll < 0.4:
            await store.retry_request(worker, bid, cid, now + rng.choice([0, 5, 30]), {"e": 1})


async def _compare(store: Any, db: Db, seed: int, rounds: int) -> int:
    """Claims against the oracle; the lines claimed in all."""
    rng, now, taken = random.Random(seed), 1000.0, 0
    await _populate(store, db, rng, now)
    for i in range(rounds):
        n = rng.choice([1, 1, 2, 3, 5, 8, 20])
        expected = [tuple(r[:2]) for r in await db.run(OLD_PICK, now, now, now, now, n)]
        got = await store.claim_requests(f"W{i % 3}", n, lease_s=rng.choice([5.0, 15.0]), now=now)
        claimed = [(c.batch_id, c.custom_id) for c in got]
        if db.pg is not None:  # PostgreSQL hands its claim back in the runner's order
            claimed = sorted(claimed, key=expected.index)
        assert claimed == expected, (seed, i, n)
        taken += len(claimed)
        now += rng.choice([0.0, 0.0, 1.0, 4.0, 11.0])
        await _churn(store, db, rng, now)
    return taken


@pytest.mark.parametrize("seed", range(6))
async def test_sqlite_claims_as_the_full_ranking(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "batch.sqlite3"
    store = SqliteBatchStore(path)
    await store.pending_requests()  # creates the file
    con = sqlite3.connect(path)
    try:
        assert await _compare(store, Db(con), seed, rounds=40) > 0
    finally:
        con.close()
        store.close()


async def test_postgres_claims_as_the_full_ranking(postgres_db: str) -> None:
    from gateway.accounts.store.postgres_batch import PostgresBatchStore

    store = PostgresBatchStore(postgres_db)
    await store.pending_requests()  # creates the tables
    con = await asyncpg.connect(postgres_db)
    try:
        for seed in range(3):
            await con.execute("DELETE FROM batch_requests; DELETE FROM batches")
            assert await _compare(store, Db(None, con), seed, rounds=30) > 0
    finally:
        await con.close()
        store.close()


def _plan(db: sqlite3.Connection, sql: str, n: int) -> str:
    return " | ".join(r[-1] for r in db.execute("EXPLAIN QUERY PLAN " + sql, ("x",) * n))


async def test_sqlite_claim_reads_through_indexes_older_files_too(tmp_path: Path) -> None:
    path = tmp_path / "batch.sqlite3"
    store = SqliteBatchStore(path)
    await store.pending_requests()
    store.close()
    with sqlite3.connect(path) as db:  # a file from before the claim's indexes
        db.execute("DROP INDEX batch_requests_claim")
        db.execute("DROP INDEX batch_requests_started")
    store = SqliteBatchStore(path)
    await store.create_batch(
        batch("batch_1", 0.0), [NewRequest(line=1, custom_id="c0", body={"prompt": "x"})]
    )
    assert [c.custom_id for c in await store.claim_requests("W", 1, 5.0, now=1.0)] == ["c0"]
    store.close()
    claim_sql = [
        claim_order.OPEN_BATCHES,
        claim_order.BUSY,
        claim_order.SERVED,
        claim_order.CANDIDATES,
        claim_order.LINE,
    ]
    with sqlite3.connect(path) as db:
        for sql in claim_sql:
            plan = _plan(db, sql, sql.count("?"))
            assert "SCAN batch_requests" not in plan, (sql, plan)
            assert "batch_requests" not in sql or "SEARCH" in plan, (sql, plan)
        # both ranges (pending, lapsed) on the claim index, in line order: no sort of the lines
        cand = _plan(db, claim_order.CANDIDATES, 7)
        assert cand.count("USING INDEX batch_requests_claim") == 2, cand
        assert "batch_requests_started" in _plan(db, claim_order.SERVED, 1)
