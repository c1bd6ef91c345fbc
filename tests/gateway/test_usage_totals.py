"""`Store.usage`'s totals per group, computed by the database
(gateway/accounts/store/usage_totals.py), on SQLite and PostgreSQL: requests, tokens (cache
reads and writes too), cost and the TTFT P50/P90 of every group — day, team, model, tier, user
and none — equal a reference computed here from the same records, and both databases answer
alike. The console's Usage page and
`duet usage report` show these rows."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from gateway.accounts.store import open_store
from gateway.accounts.store.base import Settlement, Store, UsageRecord

DAY0 = 1_793_491_200.0  # 2026-11-01 00:00 UTC
TEAMS, MODELS, TIERS, USERS = (
    ("a", "b", "c"),
    ("m1", "m2", "m3"),
    ("interactive", "batch"),
    (None, "u1", "u2"),
)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres_db")


def synthetic(n: int, seed: int = 7) -> list[UsageRecord]:
    """`n` records over three days, teams, models and tiers; a fifth with no first token, TTFTs
    with ties; costs in 1/1024 USD, so their sums are exact in any order; a tenth failed, and
    latencies with ties."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        ttft = (
            None
            if rnd.random() < 0.2
            else rnd.choice((0.25, 0.5))
            if rnd.random() < 0.2
            else rnd.uniform(0.01, 2)
        )
        out.append(
            UsageRecord(
                request_id=f"r{i}",
                team_id=rnd.choice(TEAMS),
                key_id="k",
                model_requested=rnd.choice(MODELS),
                model_used="x",
                tier=rnd.choice(TIERS),
                status="error" if rnd.random() < 0.1 else "ok",
                prompt_tokens=rnd.randint(1, 900),
                completion_tokens=rnd.randint(0, 300),
                cached_tokens=rnd.randint(0, 64),
                cost_usd=rnd.randint(0, 4096) / 1024,
                ttft_s=ttft,
                latency_s=rnd.choice((1.0, 2.5, rnd.uniform(0.05, 5))),
                created_at=DAY0 + rnd.uniform(0, 3 * 86400),
                user=rnd.choice(USERS),
                cache_write_tokens=rnd.choice((0, 16, 48)),
            )
        )
    return out


def nearest_rank(xs: list[float], tenths: int) -> float | None:
    """The value at rank min(n, floor(q·n) + 1) of the sorted TTFTs (usage_totals.py)."""
    xs = sorted(xs)
    return xs[min(len(xs), len(xs) * tenths // 10 + 1) - 1] if xs else None


GROUP = {
    "day": ("date", lambda r: time.strftime("%Y-%m-%d", time.gmtime(r.created_at))),
    "team": ("team_id", lambda r: r.team_id),
    "model": ("model", lambda r: r.model_requested),
    "tier": ("tier", lambda r: r.tier),
    "user": ("user", lambda r: r.user),
}


def reference(
    records: list[UsageRecord], group_by: str | None, team: str | None
) -> list[dict[str, Any]]:
    groups: dict[Any, list[UsageRecord]] = defaultdict(list)
    name, key = GROUP[group_by] if group_by else ("", lambda r: None)
    for r in records:
        if team is None or r.team_id == team:
            groups[key(r)].append(r)
    if group_by is None:
        groups.setdefault(None, [])
    rows = []
    for k in sorted(groups, key=lambda k: (k is not None, k or "")):  # NULL first
        rs = groups[k]
        ttfts = [r.ttft_s for r in rs if r.ttft_s is not None]
        p, c = sum(r.prompt_tokens for r in rs), sum(r.completion_tokens for r in rs)
        rows.append(
            {
                **({name: k} if group_by else {}),
                "requests": len(rs),
                "prompt_tokens": p,
                "completion_tokens": c,
                "cached_tokens": sum(r.cached_tokens for r in rs),
                "cache_write_tokens": sum(r.cache_write_tokens for r in rs),
                "total_tokens": p + c,
                "cost_usd": round(sum(r.cost_usd for r in rs), 10),
                "ttft_p50_s": nearest_rank(ttfts, 5),
                "ttft_p90_s": nearest_rank(ttfts, 9),
            }
        )
    return rows


async def fill(s: Store, records: list[UsageRecord]) -> None:
    for i in range(0, len(records), 100):
        await s.settle([Settlement(None, r) for r in records[i : i + 100]])


@pytest.mark.parametrize("group_by", [None, "day", "team", "model", "tier", "user"])
async def test_totals_and_ttft_percentiles_per_group(url: str, group_by: str | None) -> None:
    s = open_store(url)
    await s.open()
    try:
        records = synthetic(400)
        await fill(s, records)
        for team in (None, "b"):
            assert await s.usage(team, DAY0, DAY0 + 3 * 86400, group_by) == reference(
                records, group_by, team
            )
        assert await s.usage("nobody", DAY0, DAY0 + 3 * 86400, group_by) == reference(
            [], group_by, None
        )
    finally:
        await s.close()


async def test_percentile_ranks_at_small_counts(url: str) -> None:
    """n = 1..11 TTFTs of one group: the exact record each percentile picks (the ranks the
    docstring names), the group with only TTFT-less records None."""
    s = open_store(url)
    await s.open()
    try:
        records = [
            UsageRecord(
                request_id=f"r{n}-{i}",
                team_id=f"t{n}",
                key_id="k",
                model_requested="m",
                model_used="m",
                tier="interactive",
                status="ok",
                ttft_s=(i + 1) / 100,
                created_at=DAY0 + i,
            )
            for n in range(1, 12)
            for i in range(n)
        ]
        records.append(
            UsageRecord(
                request_id="none",
                team_id="t0",
                key_id="k",
                model_requested="m",
                model_used="m",
                tier="interactive",
                status="error",
                created_at=DAY0,
            )
        )
        await fill(s, records)
        rows = {r["team_id"]: r for r in await s.usage(None, DAY0, DAY0 + 86400, "team")}
        assert (rows["t0"]["ttft_p50_s"], rows["t0"]["ttft_p90_s"]) == (None, None)
        for n in range(1, 12):
            want = ((n // 2 + 1) / 100, min(n, n * 9 // 10 + 1) / 100)
            assert (rows[f"t{n}"]["ttft_p50_s"], rows[f"t{n}"]["ttft_p90_s"]) == want, n
    finally:
        await s.close()


def outliers(records: list[UsageRecord], team: str | None, limit: int) -> list[UsageRecord]:
    """The failed and the slowest tenth (latency at or above the nearest-rank P90, once there
    are 10), newest first, at most `limit` (usage_totals.outliers_sql)."""
    rs = [r for r in records if team is None or r.team_id == team]
    p90 = nearest_rank([r.latency_s for r in rs], 9) if len(rs) >= 10 else None
    picked = [r for r in rs if r.status != "ok" or (p90 is not None and r.latency_s >= p90)]
    return sorted(picked, key=lambda r: r.created_at, reverse=True)[:limit]


async def test_outliers_are_the_failed_and_the_slowest_tenth(url: str) -> None:
    s = open_store(url)
    await s.open()
    try:
        records = synthetic(400)
        await fill(s, records)
        end = DAY0 + 3 * 86400
        for team, limit in ((None, 1000), (None, 25), ("b", 1000), ("b", 3)):
            got = await s.usage_outliers(team, DAY0, end, limit)
            assert got == outliers(records, team, limit), (team, limit)
        # fewer than 10 records: no slowest tenth, only the failed ones
        first = sorted(records, key=lambda r: r.created_at)[:9]
        few = await s.usage_outliers(None, DAY0, first[-1].created_at + 1e-3, 100)
        assert few == sorted(
            [r for r in first if r.status != "ok"], key=lambda r: r.created_at, reverse=True
        )
        assert await s.usage_outliers("nobody", DAY0, end, 100) == []
    finally:
        await s.close()


async def test_record_pages_cover_the_range_once_in_order(url: str) -> None:
    """Pages of 37 (after = the last record's (created_at, request_id)) are the whole range in
    (created_at, request_id) order, each record once — records sharing a created_at across a
    page boundary included."""
    s = open_store(url)
    await s.open()
    try:
        records = synthetic(400)
        tied = [
            dataclasses.replace(records[0], request_id=f"tie-{i}", created_at=DAY0 + 7)
            for i in range(60)
        ]
        await fill(s, records + tied)
        end = DAY0 + 3 * 86400
        for team in (None, "b"):
            whole = await s.usage_records(team, DAY0, end)
            assert [(r.created_at, r.request_id) for r in whole] == sorted(
                (r.created_at, r.request_id) for r in whole
            )
            got: list[UsageRecord] = []
            after = None
            while page := await s.usage_records(team, DAY0, end, after, 37):
                assert len(page) <= 37
                got += page
                after = (page[-1].created_at, page[-1].request_id)
            assert got == whole and len(whole) == sum(
                team in (None, r.team_id) for r in records + tied
            )
    finally:
        await s.close()
