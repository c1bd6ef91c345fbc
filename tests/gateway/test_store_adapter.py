"""The LoRA adapter and the model version on usage records, in both stores (SQLite and
PostgreSQL): written and read back, grouped by (`group_by=adapter`, `group_by=version`), the
adapter carried by an expired booking's record, and a database an older version created gains
the columns at open with its records' adapter and version null."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import (
    Booked,
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


async def _bill(
    s: Store, request_id: str, adapter: str | None, cost: float, version: str | None = None
) -> None:
    req = ReserveRequest(
        team_id="t", key_id="k", request_id=request_id, tokens=10, cost_usd=0.0, ttl_s=600
    )
    res = await s.reserve(req)
    assert isinstance(res, Reservation)
    model = f"base:{adapter}" if adapter else "base"
    record = UsageRecord(
        request_id=request_id,
        team_id="t",
        key_id="k",
        model_requested=model,
        model_used=model,
        tier="interactive",
        status="ok",
        prompt_tokens=4,
        completion_tokens=3,
        cost_usd=cost,
        adapter=adapter,
        version=version,
    )
    await s.settle([Settlement(res.id, record)])


async def test_the_adapter_round_trips_and_groups(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    await _bill(s, "r1", "sql", 0.5)
    await _bill(s, "r2", None, 0.25)
    await _bill(s, "r3", "sql", 0.125)
    await _bill(s, "r4", "chat-ü", 1.0)
    recs = await s.usage_records("t", 0, 1e12)
    assert [(r.request_id, r.adapter) for r in recs] == [
        ("r1", "sql"),
        ("r2", None),
        ("r3", "sql"),
        ("r4", "chat-ü"),
    ]
    rows = await s.usage("t", 0, 1e12, "adapter")
    assert [(r["adapter"], r["requests"], r["cost_usd"]) for r in rows] == [
        (None, 1, 0.25),
        ("chat-ü", 1, 1.0),
        ("sql", 2, 0.625),
    ]
    await s.close()


async def test_an_expired_booking_bills_its_adapter(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    booked = Booked(
        model="base:sql",
        tier="interactive",
        endpoint="chat",
        prompt_tokens=9,
        prompt_cost_usd=0.5,
        adapter="sql",
    )
    t0 = time.time()
    req = ReserveRequest(
        team_id="t",
        key_id="k",
        request_id="gone",
        tokens=10,
        cost_usd=1.0,
        ttl_s=5,
        now=t0,
        booked=booked,
    )
    assert isinstance(await s.reserve(req), Reservation)
    assert await s.expire_reservations(now=t0 + 6) == 1
    [rec] = await s.usage_records("t", 0, 1e12)
    assert (rec.status, rec.model_used, rec.adapter, rec.cost_usd) == (
        "expired",
        "base:sql",
        "sql",
        0.5,
    )
    await s.close()


async def test_an_older_database_gains_the_adapter_column(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    await _bill(s, "old", None, 0.5)
    await s.close()
    if url.startswith("sqlite://"):
        import sqlite3

        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            db.execute("ALTER TABLE usage DROP COLUMN adapter")
            db.execute("ALTER TABLE usage DROP COLUMN version")
    else:
        import asyncpg

        con = await asyncpg.connect(url)
        await con.execute("ALTER TABLE usage DROP COLUMN adapter")
        await con.execute("ALTER TABLE usage DROP COLUMN version")
        await con.close()
    s = await _store(url)
    await _bill(s, "new", "sql", 0.25, "v2")
    assert [(r.request_id, r.adapter, r.version) for r in await s.usage_records("t", 0, 1e12)] == [
        ("old", None, None),
        ("new", "sql", "v2"),
    ]
    await s.close()


async def test_the_version_round_trips_and_groups_per_model(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    await _bill(s, "r1", None, 0.5, "v1")
    await _bill(s, "r2", None, 0.25, "v2")
    await _bill(s, "r3", None, 0.125, "v1")
    await _bill(s, "r4", "sql", 1.0)
    assert [r.version for r in await s.usage_records("t", 0, 1e12)] == ["v1", "v2", "v1", None]
    rows = await s.usage("t", 0, 1e12, "version")
    assert [(r["model"], r["version"], r["requests"], r["cost_usd"]) for r in rows] == [
        ("base", "v1", 2, 0.625),
        ("base", "v2", 1, 0.25),
        ("base:sql", None, 1, 1.0),
    ]
    await s.close()
