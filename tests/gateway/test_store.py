"""The stores' quota rules, exactly (SQLite and PostgreSQL): reserve → settle, the concurrency
limit, expiry of reservations whose gateway died, TPM windows, budgets, atomicity across two
processes' connections on one database; usage totals and records, with each request's OpenAI
`user`, and databases an older version created gaining the `user` column at open."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest

from gateway.accounts.keys import hash_secret, new_key
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
from gateway.accounts.store.rules import seconds_to_next_month


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_db")


async def _store(url: str) -> Store:
    s = open_store(url)
    await s.open()
    return s


def _req(
    team: str, tokens: int = 10, cost: float = 0.0, now: float | None = None, ttl: float = 600
) -> ReserveRequest:
    kw = {"now": now} if now is not None else {}
    return ReserveRequest(
        team_id=team, key_id="k", request_id="r", tokens=tokens, cost_usd=cost, ttl_s=ttl, **kw
    )


def _settle(
    res: Reservation,
    team: str,
    tokens: int,
    cost: float,
    user: str | None = None,
    request_id: str = "r",
) -> Settlement:
    return Settlement(
        res.id,
        UsageRecord(
            request_id=request_id,
            team_id=team,
            key_id="k",
            model_requested="m",
            model_used="m",
            tier="interactive",
            status="ok",
            prompt_tokens=tokens,
            cost_usd=cost,
            user=user,
        ),
    )


async def test_keys_are_stored_as_hashes(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    key, secret, digest = new_key("t", "ci")
    await s.create_key(key, digest)
    assert (await s.key_by_hash(hash_secret(secret)))[0].id == key.id
    if url.startswith("sqlite"):
        assert secret.encode() not in Path(url.removeprefix("sqlite://")).read_bytes()
    await s.revoke_key(key.id)
    assert await s.key_by_hash(hash_secret(secret)) is None
    await s.close()


async def test_update_team_sets_limits_and_keeps_the_rest(url: str) -> None:
    s = await _store(url)
    t = await s.create_team(Team(id="t", rpm=5, daily_budget_usd=1.0))
    got = await s.update_team(Team(id="t", tpm=100, default_tier="batch"))
    assert got is not None and (got.rpm, got.tpm, got.daily_budget_usd, got.default_tier) == (
        None,
        100,
        None,
        "batch",
    )
    assert got.created_at == t.created_at and await s.get_team("t") == got
    assert await s.update_team(Team(id="nobody", rpm=1)) is None
    await s.close()


async def test_concurrency_limit_and_settle(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t", max_concurrent=2))
    a, b = await s.reserve(_req("t")), await s.reserve(_req("t"))
    assert isinstance(a, Reservation) and isinstance(b, Reservation)
    third = await s.reserve(_req("t"))
    assert isinstance(third, Refusal) and third.kind == "concurrency"
    await s.settle([_settle(a, "t", 5, 0.0)])
    assert isinstance(await s.reserve(_req("t")), Reservation)
    await s.close()


async def test_stale_reservations_expire(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t", max_concurrent=1, daily_budget_usd=1.0))
    t0 = 1_000_000.0
    assert isinstance(
        await s.reserve(_req("t", cost=0.9, now=t0, ttl=30)), Reservation
    )  # its gateway "dies"
    refused = await s.reserve(_req("t", cost=0.2, now=t0 + 10))
    assert isinstance(refused, Refusal) and refused.kind == "concurrency"
    # past its TTL the dead booking no longer holds the slot or the budget
    assert isinstance(await s.reserve(_req("t", cost=0.2, now=t0 + 31)), Reservation)
    await s.close()


async def test_tpm_window_settles_to_real_tokens(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t", tpm=100))
    t0 = 2_000_000.0
    a = await s.reserve(_req("t", tokens=80, now=t0))
    assert isinstance(a, Reservation) and a.rate.remaining_tokens == 20
    r = await s.reserve(_req("t", tokens=30, now=t0 + 1))
    assert isinstance(r, Refusal) and r.kind == "tokens" and r.rate.remaining_tokens == 20
    assert 58 <= r.retry_after_s <= 60  # when a's booking leaves the window
    await s.settle([_settle(a, "t", 40, 0.0)])  # it really used 40
    assert isinstance(await s.reserve(_req("t", tokens=30, now=t0 + 2)), Reservation)
    # a minute later the window is empty again
    assert isinstance(await s.reserve(_req("t", tokens=90, now=t0 + 63)), Reservation)
    too_big = await s.reserve(_req("t", tokens=101, now=t0 + 200))
    assert isinstance(too_big, Refusal) and "more than" in too_big.message
    await s.close()


async def test_budget_counts_settled_spend_and_open_reservations(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t", monthly_budget_usd=1.0))
    a = await s.reserve(_req("t", cost=0.6))
    assert isinstance(a, Reservation)
    r = await s.reserve(_req("t", cost=0.5))
    assert isinstance(r, Refusal) and r.kind == "monthly_budget"
    await s.settle([_settle(a, "t", 10, 0.3)])  # cheaper than booked
    assert isinstance(await s.reserve(_req("t", cost=0.5)), Reservation)
    r = await s.reserve(_req("t", cost=0.5))
    assert isinstance(r, Refusal) and 0 < r.retry_after_s <= 31 * 86400
    await s.close()


async def test_two_connections_share_one_limit(url: str) -> None:
    """Two stores on one database (as two gateway processes would be) never admit more than the
    limit."""
    a, b = await _store(url), await _store(url)
    await a.create_team(Team(id="t", tpm=1000))
    results = await asyncio.gather(
        *[(a if i % 2 else b).reserve(_req("t", tokens=30)) for i in range(100)]
    )
    admitted = [r for r in results if isinstance(r, Reservation)]
    assert len(admitted) == 1000 // 30
    await a.close()
    await b.close()


def test_next_month() -> None:
    assert seconds_to_next_month(1796000000.0) == 1796083200 - 1796000000  # 2026-11-30 → 2026-12-01
    assert (
        seconds_to_next_month(1796083200.0 + 31 * 86400 - 1) == 1
    )  # 2026-12-31 23:59:59 → 2027-01-01


@pytest.mark.parametrize("group_by", [None, "model", "day", "team", "user"])
async def test_usage_grouping(url: str, group_by: str | None) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    res = await s.reserve(_req("t"))
    assert isinstance(res, Reservation)
    await s.settle([_settle(res, "t", 7, 0.25)])
    rows = await s.usage("t", 0, 1e12, group_by)
    assert (
        len(rows) == 1
        and rows[0]["requests"] == 1
        and rows[0]["prompt_tokens"] == 7
        and rows[0]["cost_usd"] == 0.25
    )
    other = await s.usage("other", 0, 1e12, group_by)
    assert other == [] if group_by else other[0]["requests"] == 0
    await s.close()


async def _settled(
    s: Store, team: str, tokens: int, cost: float, user: str | None, request_id: str
) -> None:
    res = await s.reserve(_req(team))
    assert isinstance(res, Reservation)
    await s.settle([_settle(res, team, tokens, cost, user, request_id)])


async def test_user_round_trips_and_groups(url: str) -> None:
    s = await _store(url)
    for team in ("t", "u"):
        await s.create_team(Team(id=team))
    odd = 'o\'brien "ü" 🙂 ' + "x" * 240  # quotes, non-ASCII, 256 characters: stored as given
    await _settled(s, "t", 5, 0.5, "alice", "r1")
    await _settled(s, "t", 7, 0.25, "alice", "r2")
    await _settled(s, "t", 11, 0.125, odd, "r3")
    await _settled(s, "t", 13, 0.0, None, "r4")
    await _settled(s, "u", 17, 1.0, "alice", "r5")  # another team's alice
    recs = await s.usage_records("t", 0, 1e12)
    assert [(r.request_id, r.user) for r in recs] == [
        ("r1", "alice"),
        ("r2", "alice"),
        ("r3", odd),
        ("r4", None),
    ]
    rows = await s.usage("t", 0, 1e12, "user")
    assert [(r["user"], r["requests"], r["prompt_tokens"], r["cost_usd"]) for r in rows] == [
        (None, 1, 13, 0.0),
        ("alice", 2, 12, 0.75),
        (odd, 1, 11, 0.125),
    ]
    everyone = await s.usage(None, 0, 1e12, "user")
    assert [(r["user"], r["requests"]) for r in everyone] == [(None, 1), ("alice", 3), (odd, 1)]
    await s.close()


# the usage table as versions before the `user` column created it (in WAL mode, as they left it)
OLD_SQLITE_USAGE = """
PRAGMA journal_mode=WAL;
CREATE TABLE usage (
    request_id TEXT NOT NULL, team_id TEXT NOT NULL, key_id TEXT NOT NULL,
    model_requested TEXT NOT NULL, model_used TEXT NOT NULL, tier TEXT NOT NULL,
    status TEXT NOT NULL, endpoint TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, cost_usd REAL NOT NULL,
    ttft_s REAL, latency_s REAL NOT NULL, nodes TEXT NOT NULL, created_at REAL NOT NULL);
CREATE INDEX usage_team_time ON usage (team_id, created_at);
INSERT INTO usage VALUES ('old-1', 't', 'k', 'm', 'm', 'interactive', 'ok', 'chat',
                          3, 4, 0, 0.5, 0.1, 0.2, '["n1"]', 1000.0);
"""


async def test_old_sqlite_file_gains_the_user_column(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SQLITE_USAGE)
    # two gateways opening the old file at once: the column is added once, neither fails
    a, b = open_store(f"sqlite://{path}"), open_store(f"sqlite://{path}")
    await asyncio.gather(a.open(), b.open())
    await b.close()
    with sqlite3.connect(path) as db:
        assert [r[1] for r in db.execute("PRAGMA table_info(usage)")][-7:] == [
            "user",
            "migrations",
            "leg_tokens",
            "queue_s",
            "adapter",
            "version",
            "cache_write_tokens",
        ]
    [old] = await a.usage_records(None, 0, 1e12)
    assert (old.request_id, old.user, old.nodes, old.prompt_tokens) == ("old-1", None, ["n1"], 3)
    assert (old.migrations, old.leg_tokens) == (0, [])  # a record from before stream migration
    assert old.queue_s is None  # and from before the admission wait was recorded
    assert old.cache_write_tokens == 0  # and from before cache writes were
    await a.create_team(Team(id="t"))
    await _settled(a, "t", 5, 0.25, "alice", "new-1")
    assert [(r["user"], r["requests"]) for r in await a.usage("t", 0, 1e12, "user")] == [
        (None, 1),
        ("alice", 1),
    ]
    await a.close()
    again = await _store(f"sqlite://{path}")  # already migrated: opens as is
    assert [r.user for r in await again.usage_records("t", 0, 1e12)] == [None, "alice"]
    await again.close()


async def test_old_postgres_database_gains_the_user_column(postgres_db: str) -> None:
    import asyncpg

    s = await _store(postgres_db)
    await s.close()
    con = await asyncpg.connect(postgres_db)
    try:  # back to the schema versions before the `user` column created, with one old row
        for column in ('"user"', "migrations", "leg_tokens", "queue_s", "cache_write_tokens"):
            await con.execute(f"ALTER TABLE usage DROP COLUMN {column}")
        await con.execute("ALTER TABLE reservations DROP COLUMN streamed_tokens")
        await con.execute(
            "INSERT INTO usage (request_id, team_id, key_id, model_requested, model_used, tier, "
            "status, endpoint, prompt_tokens, completion_tokens, cached_tokens, cost_usd, ttft_s, "
            "latency_s, nodes, created_at) VALUES ('old-1', 't', 'k', 'm', 'm', 'interactive', "
            "'ok', 'chat', 3, 4, 0, 0.5, 0.1, 0.2, '[\"n1\"]', 1000.0)"
        )
        s = await _store(postgres_db)
        [old] = await s.usage_records(None, 0, 1e12)
        assert (old.request_id, old.user, old.nodes, old.migrations, old.leg_tokens) == (
            "old-1",
            None,
            ["n1"],
            0,
            [],
        )
        assert old.queue_s is None and old.cache_write_tokens == 0
        await s.create_team(Team(id="t"))
        await _settled(s, "t", 5, 0.25, "alice", "new-1")
        assert [r.user for r in await s.usage_records("t", 0, 1e12)] == [None, "alice"]
        assert (
            await con.fetchval(
                "SELECT count(*) FROM information_schema.columns WHERE table_name = "
                "'reservations' AND column_name = 'streamed_tokens'"
            )
            == 1
        )
        # Up to date, a gateway's open takes no lock on usage (ALTER TABLE would wait for every
        # reader and writer of it: the deadlock the schema-only-when-missing rule avoids).
        async with con.transaction():
            await con.execute(
                "LOCK TABLE usage IN ROW EXCLUSIVE MODE"
            )  # as a settling gateway holds it
            late = await asyncio.wait_for(_store(postgres_db), timeout=30)
        await late.close()
        await s.close()
    finally:
        await con.close()


def _booked(tokens: int = 100, cost: float = 0.25) -> Booked:
    return Booked(
        model="m", tier="interactive", endpoint="chat", prompt_tokens=tokens, prompt_cost_usd=cost
    )


async def test_a_live_gateways_heartbeat_keeps_its_reservations(url: str) -> None:
    """A request outliving the reservation TTL still counts while its gateway beats."""
    s = await _store(url)
    await s.create_team(Team(id="t", max_concurrent=1))
    t0 = 2_000_000.0
    res = await s.reserve(
        ReserveRequest(
            team_id="t",
            key_id="k",
            request_id="r",
            tokens=10,
            cost_usd=0.5,
            ttl_s=30,
            now=t0,
            gateway_id="gw-a",
            booked=_booked(),
        )
    )
    assert isinstance(res, Reservation)
    await s.heartbeat("gw-a", 30, now=t0 + 25)  # renewed to t0 + 55
    assert await s.expire_reservations(now=t0 + 40) == 0
    assert isinstance(await s.reserve(_req("t", now=t0 + 40)), Refusal)  # still in flight
    await s.close()


async def test_a_dead_gateways_reservations_are_reclaimed_and_billed(url: str) -> None:
    """A gateway that stops beating is dead: any live gateway reclaims its bookings (the team
    may send again) and bills each booked prompt with an `expired` usage record."""
    s = await _store(url)
    await s.create_team(Team(id="t", max_concurrent=1, daily_budget_usd=1.0))
    t0 = time.time()
    await s.heartbeat("gw-dead", 900, now=t0)
    res = await s.reserve(
        ReserveRequest(
            team_id="t",
            key_id="k",
            request_id="req-killed",
            tokens=10,
            cost_usd=0.5,
            ttl_s=900,
            now=t0,
            gateway_id="gw-dead",
            booked=_booked(),
        )
    )
    assert isinstance(res, Reservation)
    await s.heartbeat("gw-live", 900, now=t0 + 12)
    assert await s.reclaim(12.5, now=t0 + 12) == 0  # not dead yet
    assert await s.reclaim(12.5, now=t0 + 13) == 1
    assert isinstance(await s.reserve(_req("t", now=t0 + 13)), Reservation)
    records = await s.usage_records("t", t0 - 1, t0 + 100)
    assert [(r.request_id, r.status, r.prompt_tokens, r.cost_usd) for r in records] == [
        ("req-killed", "expired", 100, 0.25)
    ]
    spent = await s.reserve(_req("t", cost=0.8, now=t0 + 14))  # 0.25 spent + 0.8 > 1.0
    assert (isinstance(spent, Refusal) and spent.kind == "concurrency") or (
        isinstance(spent, Refusal) and spent.kind == "daily_budget"
    )
    await s.close()


async def test_a_restarted_gateway_reclaims_its_previous_life_at_once(url: str) -> None:
    """A named gateway (`[server] instance`, what `duet up` sets) that starts again reclaims its
    dead life's bookings as it starts — billed, the team's slot freed — without waiting for the
    heartbeats to run out; another instance's bookings (even one whose name extends it, or
    a '_' that LIKE would take as a wildcard) and its own new life's are untouched."""
    s = await _store(url)
    for team in ("t", "u", "v"):
        await s.create_team(Team(id=team, max_concurrent=1))
    t0 = time.time()

    async def book(team: str, gateway: str, rid: str) -> None:
        res = await s.reserve(
            ReserveRequest(
                team_id=team,
                key_id="k",
                request_id=rid,
                tokens=10,
                cost_usd=0.5,
                ttl_s=900,
                now=t0,
                gateway_id=gateway,
                booked=_booked(),
            )
        )
        assert isinstance(res, Reservation)

    for gw in ("gw_0/dead", "gw_0-1/live", "gwx0/live"):
        await s.heartbeat(gw, 900, now=t0)
    await book("t", "gw_0/dead", "req-dead")
    await book("u", "gw_0-1/live", "req-other")
    await book("v", "gwx0/live", "req-lookalike")  # 'gw_0' as a LIKE pattern would match 'gwx0'
    assert await s.reclaim_previous("gw_0", "gw_0/new", now=t0 + 1) == 1
    assert isinstance(
        await s.reserve(_req("t", now=t0 + 1)), Reservation
    )  # the slot is free at once
    assert [(r.request_id, r.status) for r in await s.usage_records("t", t0 - 1, t0 + 100)] == [
        ("req-dead", "expired")
    ]
    assert (
        await s.usage_records("u", t0 - 1, t0 + 100)
        == []
        == await s.usage_records("v", t0 - 1, t0 + 100)
    )
    assert await s.reclaim_previous("gw_0", "gw_0/new", now=t0 + 2) == 0
    await s.close()


async def test_an_expired_reservation_bills_its_prompt(url: str) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    t0 = time.time()
    booked = dataclasses.replace(_booked(40, 0.1), user="end-user-7")
    await s.reserve(
        ReserveRequest(
            team_id="t",
            key_id="k",
            request_id="req-lapsed",
            tokens=10,
            cost_usd=0.5,
            ttl_s=5,
            now=t0,
            booked=booked,
        )
    )
    assert await s.expire_reservations(now=t0 + 6) == 1
    records = await s.usage_records("t", t0 - 1, t0 + 100)
    # the request's `user` stays on its record (spend per end user; bench/chaos_usage.py matches by
    # it)
    assert [(r.status, r.prompt_tokens, r.cost_usd, r.user) for r in records] == [
        ("expired", 40, 0.1, "end-user-7")
    ]
    await s.close()


async def test_a_dead_gateways_streams_bill_what_they_had_sent(url: str) -> None:
    """Each heartbeat reports the completion tokens its in-flight streams have sent;
    a reclaimed booking bills them (at its booked completion price) besides its prompt, and the
    team's token window keeps them. A late, lower report never lowers the count, and a gateway
    cannot report on another's bookings."""
    s = await _store(url)
    await s.create_team(Team(id="t", tpm=1000))
    await s.create_team(Team(id="u"))
    t0 = time.time()
    booked = dataclasses.replace(
        _booked(100, 0.25), completion_usd_per_mtok=10_000.0
    )  # 0.01 a token
    await s.heartbeat("gw-dead", 900, now=t0)
    await s.heartbeat("gw-live", 900, now=t0)
    dead = await s.reserve(
        ReserveRequest(
            team_id="t",
            key_id="k",
            request_id="req-stream",
            tokens=900,
            cost_usd=5.0,
            ttl_s=900,
            now=t0,
            gateway_id="gw-dead",
            booked=booked,
        )
    )
    live = await s.reserve(
        ReserveRequest(
            team_id="u",
            key_id="k",
            request_id="req-live",
            tokens=900,
            cost_usd=5.0,
            ttl_s=900,
            now=t0,
            gateway_id="gw-live",
            booked=booked,
        )
    )
    assert isinstance(dead, Reservation) and isinstance(live, Reservation)
    await s.heartbeat(
        "gw-dead", 900, now=t0 + 1, streamed={dead.id: 7, live.id: 50}
    )  # live's is not its own
    await s.heartbeat("gw-dead", 900, now=t0 + 2, streamed={dead.id: 5})  # late and lower: 7 stays
    await s.heartbeat("gw-live", 900, now=t0 + 14)
    assert await s.reclaim(12.5, now=t0 + 15) == 1
    [rec] = await s.usage_records("t", t0 - 1, t0 + 100)
    assert (rec.request_id, rec.status, rec.prompt_tokens, rec.completion_tokens) == (
        "req-stream",
        "expired",
        100,
        7,
    )
    assert rec.cost_usd == pytest.approx(0.25 + 7 * 0.01)
    # the window keeps what was billed (prompt + streamed), not the 900 booked
    ok = await s.reserve(_req("t", tokens=1, now=t0 + 15))
    assert (
        isinstance(ok, Reservation) and ok.rate.remaining_tokens == 1000 - 107 - 1
    )  # (this request's 1 too)
    assert [
        r.completion_tokens for r in await s.usage_records("u", t0 - 1, t0 + 100)
    ] == []  # live: in flight
    assert (
        await s.reclaim(1, now=t0 + 100) == 1
    )  # gw-live dies too: its booking streamed nothing it reported
    [other] = await s.usage_records("u", t0 - 1, t0 + 200)
    assert (other.completion_tokens, other.cost_usd) == (0, 0.25)
    await s.close()


async def test_an_expired_booking_of_an_older_version_bills_its_prompt(tmp_path: Path) -> None:
    """A file an older version wrote (no streamed_tokens column, bookings without a completion
    price) gains the column at open; its bookings bill their prompt, as they did."""
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:
        db.executescript(OLD_SQLITE_RESERVATIONS)
    s = await _store(f"sqlite://{path}")
    assert await s.reclaim(10, now=OLD_T0 + 60) == 1
    [rec] = await s.usage_records("t", 0, 1e12)
    assert (rec.request_id, rec.status, rec.prompt_tokens, rec.completion_tokens, rec.cost_usd) == (
        "req-old",
        "expired",
        40,
        0,
        0.1,
    )
    await s.close()
    with sqlite3.connect(path) as db:
        assert "streamed_tokens" in [r[1] for r in db.execute("PRAGMA table_info(reservations)")]


OLD_T0 = 3_000_000.0
# the reservations table (and a booking in it) as versions before streamed_tokens left them
OLD_SQLITE_RESERVATIONS = f"""
PRAGMA journal_mode=WAL;
CREATE TABLE teams (
    id TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, max_concurrent INTEGER,
    daily_budget_usd REAL, monthly_budget_usd REAL, default_tier TEXT NOT NULL,
    created_at REAL NOT NULL);
INSERT INTO teams VALUES ('t', NULL, NULL, NULL, NULL, NULL, 'interactive', 0);
CREATE TABLE reservations (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, key_id TEXT NOT NULL, request_id TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL, tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, gateway_id TEXT, booked TEXT);
INSERT INTO reservations VALUES ('rsv-old', 't', 'k', 'req-old', {OLD_T0}, {OLD_T0 + 900}, 90,
    0.5, 'gw-old',
    '{{"model":"m","tier":"interactive","endpoint":"chat","prompt_tokens":40,"prompt_cost_usd":0.1}}');
CREATE TABLE gateways (id TEXT PRIMARY KEY, heartbeat_at REAL NOT NULL);
INSERT INTO gateways VALUES ('gw-old', {OLD_T0});
"""
