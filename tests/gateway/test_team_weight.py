"""A team's fair-share weight through the admin API: stored with the team in both stores (a
column added to older databases when they open), shown by the team read, and taken by the tier
scheduler at the team's next request, without a restart.

Real parts: both stores (SQLite, PostgreSQL), and a real gateway with one slot in front of a
real node (`one_slot_gateway`), whose admission order shows the weight (orders only, no
timing bounds).
"""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import Team
from tests.gateway.conftest import GatewayOnNode
from tests.gateway.helpers import MODEL, http, make_team
from tests.procs import Proc
from tests.wait import until


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_db")


async def test_both_stores_keep_a_teams_weight(url: str) -> None:
    s = open_store(url)
    await s.open()
    try:
        assert (await s.create_team(Team(id="w", weight=2.5))).weight == 2.5
        got = await s.get_team("w")
        assert got is not None and got.weight == 2.5
        assert [t.weight for t in await s.list_teams() if t.id == "w"] == [2.5]
        updated = await s.update_team(Team(id="w", rpm=3, weight=0.5))
        assert updated is not None and (updated.rpm, updated.weight) == (3, 0.5)
        cleared = await s.update_team(Team(id="w"))
        assert cleared is not None and cleared.weight is None  # gateway.toml's again
    finally:
        await s.close()


OLD_TEAMS = """
CREATE TABLE teams (
    id TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, max_concurrent INTEGER,
    daily_budget_usd REAL, monthly_budget_usd REAL, default_tier TEXT NOT NULL,
    created_at REAL NOT NULL);
INSERT INTO teams VALUES ('old', 7, NULL, NULL, NULL, NULL, 'interactive', 1000.0);
"""


async def test_an_older_sqlite_file_gains_the_weight_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_TEAMS)
    s = open_store(f"sqlite://{path}")
    await s.open()
    try:
        old = await s.get_team("old")
        assert old is not None and (old.rpm, old.weight) == (7, None)
        assert (await s.update_team(Team(id="old", rpm=7, weight=3.0))) == Team(
            id="old", rpm=7, created_at=1000.0, weight=3.0
        )
    finally:
        await s.close()


async def test_an_older_postgres_database_gains_the_weight_column(postgres_db: str) -> None:
    import asyncpg

    s = open_store(postgres_db)
    await s.open()
    await s.create_team(Team(id="old", rpm=7))
    await s.close()
    con = await asyncpg.connect(postgres_db)
    try:
        await con.execute("ALTER TABLE teams DROP COLUMN weight")
    finally:
        await con.close()
    s = open_store(postgres_db)
    await s.open()
    try:
        old = await s.get_team("old")
        assert old is not None and (old.rpm, old.weight) == (7, None)
        updated = await s.update_team(Team(id="old", rpm=7, weight=3.0))
        assert updated is not None and updated.weight == 3.0
    finally:
        await s.close()


def test_the_admin_api_sets_checks_and_shows_the_weight(one_slot_gateway: Proc) -> None:
    g = one_slot_gateway.url
    make_team(g, "w", rpm=100)
    status, _, body = http(f"{g}/admin/teams/w", "PATCH", {"weight": 4})
    assert status == 200 and (body["weight"], body["rpm"]) == (4, 100), body  # rpm kept
    assert http(f"{g}/admin/teams/w")[2]["weight"] == 4
    for bad in (0, -1, 1e9, "heavy"):
        status, _, body = http(f"{g}/admin/teams/w", "PATCH", {"weight": bad})
        assert status == 400, (bad, body)
    assert http(f"{g}/admin/teams/w")[2]["weight"] == 4  # a refused change changed nothing
    assert http(f"{g}/admin/teams/w", "PATCH", {"weight": 1}, key="sk-duet-nope")[0] == 401
    assert http(f"{g}/admin/teams/nobody", "PATCH", {"weight": 1})[0] == 404
    # PUT sets every field: weight left out is gateway.toml's again
    status, _, body = http(f"{g}/admin/teams/w", "PUT", {"rpm": 5})
    assert status == 200 and body["weight"] is None and body["rpm"] == 5, body


async def test_a_patched_weight_orders_the_busy_tier_without_a_restart(
    one_slot: GatewayOnNode,
) -> None:
    """Team a holds the one slot and queues one long request; team b queues two short ones.
    b's first goes at the first freed slot (b joined level with a, and a's holder was charged
    its 400 output tokens). Then the weights decide: at weight 1 b's first short request cost
    far less than a's holder, so b's second goes next (seen so before the weight was stored);
    with b's weight PATCHed to 0.001 after its keys were in use, the same short request cost b
    a thousand times more, and a's queued request goes before b's second. The node is paused
    while the queue forms, so the holder keeps the slot however fast the node would have
    finished it."""
    g = one_slot.gateway.url
    auth = {t: {"Authorization": f"Bearer {make_team(g, t)}"} for t in ("a", "b")}
    url = g + "/v1/completions"
    short = {"model": MODEL, "prompt": "b", "max_tokens": 4, "ignore_eos": True}
    async with aiohttp.ClientSession() as s:
        async with s.post(url, json=short, headers=auth["b"]) as warm:  # b's key is cached
            assert warm.status == 200
        status, _, body = http(f"{g}/admin/teams/b", "PATCH", {"weight": 0.001})
        assert status == 200 and body["weight"] == 0.001, body
        long = {"model": MODEL, "prompt": "hold", "max_tokens": 400, "ignore_eos": True}
        order: list[str] = []

        async def ask(name: str, team: str, body: dict[str, object]) -> None:
            async with s.post(url, json=body, headers=auth[team]) as r:
                await r.read()
                assert r.status == 200, await r.text()
                order.append(name)

        tasks = []
        with one_slot.node_paused():
            holding = asyncio.ensure_future(
                s.post(url, json={**long, "stream": True}, headers=auth["a"])
            )
            await until(lambda: _running(g) == 1, timeout=60)
            for i, (name, team, body) in enumerate(
                [("a1", "a", {**long, "max_tokens": 8}), ("b1", "b", short), ("b2", "b", short)]
            ):
                tasks.append(asyncio.ensure_future(ask(name, team, body)))
                await until(lambda i=i: _waiting(g) == i + 1, timeout=60)
        holder = await asyncio.wait_for(holding, 120)
        assert holder.status == 200 and holder.headers["x-duet-queue-ms"] == "0"
        async for _ in holder.content:
            pass
        holder.close()
        await asyncio.wait_for(asyncio.gather(*tasks), 300)
    assert order == ["b1", "a1", "b2"]


def _waiting(url: str) -> int:
    return int(http(url + "/health")[2]["waiting"]["interactive"])


def _running(url: str) -> int:
    return int(http(url + "/health")[2]["running"])
