"""The SQLite store's quota rules, exactly: reserve → settle, the concurrency limit, expiry of
reservations whose gateway died, TPM windows, budgets, and atomicity across two processes'
connections on one file."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.keys import hash_secret, new_key
from gateway.store import open_store
from gateway.store.base import (
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    Team,
    UsageRecord,
)
from gateway.store.rules import seconds_to_next_month


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_db")


async def _store(url: str) -> Store:
    s = open_store(url)
    await s.open()
    return s


def _req(team: str, tokens: int = 10, cost: float = 0.0, now: float | None = None, ttl: float = 600) -> ReserveRequest:
    kw = {"now": now} if now is not None else {}
    return ReserveRequest(team_id=team, key_id="k", request_id="r", tokens=tokens, cost_usd=cost, ttl_s=ttl, **kw)


def _settle(res: Reservation, team: str, tokens: int, cost: float) -> Settlement:
    return Settlement(res.id, UsageRecord(request_id="r", team_id=team, key_id="k", model_requested="m",
                                          model_used="m", tier="interactive", status="ok", prompt_tokens=tokens,
                                          cost_usd=cost))  # fmt: skip


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
    assert isinstance(await s.reserve(_req("t", cost=0.9, now=t0, ttl=30)), Reservation)  # its gateway "dies"
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
    """Two stores on one database (as two gateway processes would be) never admit more than the limit."""
    a, b = await _store(url), await _store(url)
    await a.create_team(Team(id="t", tpm=1000))
    results = await asyncio.gather(*[(a if i % 2 else b).reserve(_req("t", tokens=30)) for i in range(100)])
    admitted = [r for r in results if isinstance(r, Reservation)]
    assert len(admitted) == 1000 // 30
    await a.close()
    await b.close()


def test_next_month() -> None:
    assert seconds_to_next_month(1796000000.0) == 1796083200 - 1796000000  # 2026-11-30 → 2026-12-01
    assert seconds_to_next_month(1796083200.0 + 31 * 86400 - 1) == 1  # 2026-12-31 23:59:59 → 2027-01-01


@pytest.mark.parametrize("group_by", [None, "model", "day"])
async def test_usage_grouping(url: str, group_by: str | None) -> None:
    s = await _store(url)
    await s.create_team(Team(id="t"))
    res = await s.reserve(_req("t"))
    assert isinstance(res, Reservation)
    await s.settle([_settle(res, "t", 7, 0.25)])
    rows = await s.usage("t", 0, 1e12, group_by)
    assert len(rows) == 1 and rows[0]["requests"] == 1 and rows[0]["prompt_tokens"] == 7 and rows[0]["cost_usd"] == 0.25
    other = await s.usage("other", 0, 1e12, group_by)
    assert other == [] if group_by else other[0]["requests"] == 0
    await s.close()
