"""The cache-write tokens of a usage record (`cache_write_tokens`: the prompt tokens a request
computed and wrote to the prefix cache to keep, Anthropic's `cache_creation_input_tokens`) in
both stores (SQLite and PostgreSQL): written and read back, summed in the usage totals, and a
database an older version created gains the column at open, its records reading 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import (
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    Team,
    UsageRecord,
)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_db")


async def _store(url: str) -> Store:
    s = open_store(url)
    await s.open()
    return s


async def _bill(s: Store, request_id: str, written: int, cached: int = 0) -> None:
    req = ReserveRequest(
        team_id="t", key_id="k", request_id=request_id, tokens=100, cost_usd=0.0, ttl_s=600
    )
    res = await s.reserve(req)
    assert isinstance(res, Reservation)
    record = UsageRecord(
        request_id=request_id,
        team_id="t",
        key_id="k",
        model_requested="m",
        model_used="m",
        tier="interactive",
        status="ok",
        prompt_tokens=80,
        completion_tokens=3,
        cached_tokens=cached,
        cache_write_tokens=written,
        cost_usd=0.5,
    )
    await s.settle([Settlement(res.id, record)])


async def test_cache_writes_round_trip_and_total(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    await _bill(s, "write", 64)
    await _bill(s, "read", 0, cached=64)
    await _bill(s, "more", 16, cached=64)
    recs = await s.usage_records("t", 0, 1e12)
    assert [(r.request_id, r.cache_write_tokens, r.cached_tokens) for r in recs] == [
        ("write", 64, 0),
        ("read", 0, 64),
        ("more", 16, 64),
    ]
    [total] = await s.usage("t", 0, 1e12, None)
    assert (total["cache_write_tokens"], total["cached_tokens"]) == (80, 128), total
    [team] = await s.usage(None, 0, 1e12, "team")
    assert (team["team_id"], team["cache_write_tokens"]) == ("t", 80), team
    await s.close()


async def test_an_older_database_gains_the_cache_write_column(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    await _bill(s, "old", 32)
    await s.close()
    if url.startswith("sqlite://"):
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            db.execute("ALTER TABLE usage DROP COLUMN cache_write_tokens")
    else:
        import asyncpg

        con = await asyncpg.connect(url)
        await con.execute("ALTER TABLE usage DROP COLUMN cache_write_tokens")
        await con.close()
    s = await _store(url)  # opening adds the column back, empty for the old record
    await _bill(s, "new", 48)
    recs = await s.usage_records("t", 0, 1e12)
    assert [(r.request_id, r.cache_write_tokens) for r in recs] == [("old", 0), ("new", 48)]
    [total] = await s.usage("t", 0, 1e12, None)
    assert total["cache_write_tokens"] == 48, total
    await s.close()
