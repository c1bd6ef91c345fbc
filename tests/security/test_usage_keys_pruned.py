"""The usage keys table does not grow without bound: every keyed record (a request sent with an
`Idempotency-Key`, a batch line, an expired booking) leaves a row in `usage_keys`, and nothing
removed them. Now each keyed write prunes a few keys billed more than `RETAIN_S` ago, oldest
first, and keys younger than that — the retry window and a batch's whole life — stay, with what
they decide (a retry still replaces its dead attempt's record).

Real parts: both gateway stores (SQLite, and PostgreSQL from pgserver); the old keys are written
straight into the database, as months of traffic would have left them.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

import asyncpg

from gateway.accounts.store.base import Settlement, Store, UsageKey
from gateway.accounts.store.usage_keys import PRUNE_PER_WRITE, RETAIN_S
from tests.gateway.conftest import postgres, postgres_db  # noqa: F401  (a real PostgreSQL)
from tests.security.test_batch_billed_once import (  # noqa: F401  (fixtures: both stores)
    _record,
    store,
    store_url,
)

OLD, RECENT = 10, 3


async def _sql(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    if url.startswith("sqlite://"):
        with sqlite3.connect(url.removeprefix("sqlite://")) as db:
            return db.execute(sql.replace("$", "?"), args).fetchall()  # ?NNN: numbered
    con = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await con.fetch(sql, *args)]
    finally:
        await con.close()


async def _seed(url: str, now: float) -> None:
    ages = [RETAIN_S + 86400 * (i + 1) for i in range(OLD)] + [86400.0] * RECENT
    for i, age in enumerate(ages):
        await _sql(
            url,
            "INSERT INTO usage_keys (request_id, team_id, cost_usd, created_at, billed_at) "
            "VALUES ($1, 't', 0.1, $2, $2)",
            f"{'old' if age > RETAIN_S else 'recent'}-{i}",
            now - age,
        )


async def _keys(url: str) -> list[str]:
    return sorted(r[0] for r in await _sql(url, "SELECT request_id FROM usage_keys"))


async def test_each_keyed_write_prunes_the_oldest_keys_past_retention(
    store: Store,  # noqa: F811  (the fixture imported above)
    store_url: str,  # noqa: F811
) -> None:
    await _seed(store_url, time.time())
    await store.settle([Settlement(None, _record("k-1", 0.01), key=UsageKey.RETRY)])
    keys = await _keys(store_url)
    old = [k for k in keys if k.startswith("old-")]
    assert len(old) == OLD - PRUNE_PER_WRITE
    # the oldest went first: old-9 is the oldest (its age grows with its index)
    assert f"old-{OLD - 1}" not in old and "old-0" in old
    assert [k for k in keys if k.startswith("recent-")] == [f"recent-{OLD + i}" for i in range(3)]
    assert "k-1" in keys
    # a write without a key prunes nothing; keyed ones drain the backlog
    await store.settle([Settlement(None, _record("plain", 0.01))])
    assert len(await _keys(store_url)) == len(keys)
    for i in range(2, 5):
        await store.settle([Settlement(None, _record(f"k-{i}", 0.01), key=UsageKey.RETRY)])
    keys = await _keys(store_url)
    assert not [k for k in keys if k.startswith("old-")]
    assert len(keys) == RECENT + 4


async def test_a_recent_key_still_decides_after_a_prune(
    store: Store,  # noqa: F811  (the fixture imported above)
    store_url: str,  # noqa: F811
) -> None:
    """A key answered a day ago is no free pass, prune or not: the same key is billed again."""
    await _seed(store_url, time.time())
    await store.settle([Settlement(None, _record("again", 0.2), key=UsageKey.RETRY)])
    await store.settle([Settlement(None, _record("again", 0.3), key=UsageKey.RETRY)])
    rows = await _sql(store_url, "SELECT cost_usd FROM usage WHERE request_id = 'again'")
    assert sorted(r[0] for r in rows) == [0.2, 0.3]
