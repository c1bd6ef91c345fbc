"""The PostgreSQL store's usage records: their columns, the row mapper, and the write of a
settlement batch's records with their spend — each under its key when it has one (usage_keys.py
decides what a second record of a key does; this carries it out in the caller's transaction,
under the key row's lock)."""

from __future__ import annotations

import json
from typing import Any

from gateway.accounts.store.base import USAGE_COLS, UsageKey, UsageRecord
from gateway.accounts.store.rules import day_period, month_period
from gateway.accounts.store.usage_keys import (
    PRUNE_PER_WRITE,
    PRUNE_SQL,
    RETAIN_S,
    Earlier,
    Verdict,
    needs_status,
    verdict,
)

_PRUNE = PRUNE_SQL.format(lock=" FOR UPDATE SKIP LOCKED").replace("?", "$1", 1).replace("?", "$2")
#: list columns stored as JSON text
JSON_COLS = ("nodes", "leg_tokens")
# quoted: `user` is a reserved word in PostgreSQL (unquoted it means CURRENT_USER)
USAGE_SQL = ", ".join(f'"{c}"' for c in USAGE_COLS)


def usage_record_of(r: Any) -> UsageRecord:
    return UsageRecord(
        **{
            **dict(r),
            "nodes": json.loads(r["nodes"]),
            "migrations": r["migrations"] or 0,
            "leg_tokens": json.loads(r["leg_tokens"] or "[]"),
            "cache_write_tokens": r["cache_write_tokens"] or 0,  # NULL: from before the column
        }
    )


async def write_usage(con: Any, keyed: list[tuple[UsageRecord, UsageKey]], now: float) -> None:
    """Write each record with its spend; one with a key (base.Settlement.key) is written at once
    after its key is taken, so a second record of the same key in this batch finds the first."""
    plain = [r for r, key in keyed if key is UsageKey.NONE]
    for r, key in keyed:
        if key is not UsageKey.NONE and await take_key(con, r, now, key):
            await insert_usage(con, [r], now)
    if len(plain) < len(keyed):
        await con.execute(_PRUNE, now - RETAIN_S, PRUNE_PER_WRITE * (len(keyed) - len(plain)))
    if plain:
        await insert_usage(con, plain, now)


async def take_key(con: Any, r: UsageRecord, now: float, key: UsageKey) -> bool:
    """True to write `r` under its key (usage_keys.verdict): the key is new, or `r` replaces
    the key's earlier record (taken back here with its spend), or is billed beside it. The key
    row's lock orders two gateways settling one key: the second waits for the first's commit,
    then judges against its record."""
    if await con.fetchval(
        "INSERT INTO usage_keys (request_id, team_id, cost_usd, created_at, billed_at) "
        "VALUES ($1,$2,$3,$4,$5) ON CONFLICT (request_id) DO NOTHING RETURNING 1",
        r.request_id,
        r.team_id,
        r.cost_usd,
        r.created_at,
        now,
    ):
        return True
    old = await con.fetchrow(
        "SELECT team_id, cost_usd, created_at, billed_at FROM usage_keys WHERE request_id=$1 "
        "FOR UPDATE",
        r.request_id,
    )
    status = None
    if needs_status(key, r.status):
        # (team_id, created_at) is the usage table's index: no scan for the old record
        status = await con.fetchval(
            "SELECT status FROM usage WHERE team_id=$1 AND created_at=$2 AND request_id=$3",
            old["team_id"],
            old["created_at"],
            r.request_id,
        )
    earlier = Earlier(team_id=old["team_id"], billed_at=old["billed_at"], status=status)
    v = verdict(key, r.team_id, r.status, earlier, now)
    if v is Verdict.SKIP:
        return False
    if v is Verdict.REPLACE:
        await _take_back(con, old, r.request_id)
    await con.execute(
        "UPDATE usage_keys SET team_id=$2, cost_usd=$3, created_at=$4, billed_at=$5 "
        "WHERE request_id=$1",
        r.request_id,
        r.team_id,
        r.cost_usd,
        r.created_at,
        now,
    )
    return True


async def _take_back(con: Any, old: Any, request_id: str) -> None:
    """Delete the key's earlier record and take its cost out of the spend it was billed to."""
    await con.execute(
        "DELETE FROM usage WHERE team_id=$1 AND created_at=$2 AND request_id=$3",
        old["team_id"],
        old["created_at"],
        request_id,
    )
    if old["cost_usd"] > 0:
        await con.execute(
            "UPDATE spend SET cost_usd = cost_usd - $1 "
            "WHERE team_id=$2 AND period = ANY($3::text[])",
            old["cost_usd"],
            old["team_id"],
            [day_period(old["billed_at"]), month_period(old["billed_at"])],
        )


async def insert_usage(con: Any, records: list[UsageRecord], now: float) -> None:
    for r in records:
        if r.cost_usd > 0:
            for period in (day_period(now), month_period(now)):
                await con.execute(
                    "INSERT INTO spend (team_id, period, cost_usd) VALUES ($1,$2,$3) "
                    "ON CONFLICT (team_id, period) DO UPDATE SET cost_usd = spend.cost_usd + "
                    "excluded.cost_usd",
                    r.team_id,
                    period,
                    r.cost_usd,
                )
    await con.executemany(_INSERT_USAGE, [_values(r) for r in records])


_INSERT_USAGE = (
    f"INSERT INTO usage ({USAGE_SQL}) "
    f"VALUES ({', '.join(f'${i + 1}' for i in range(len(USAGE_COLS)))})"
)


def _values(r: UsageRecord) -> list[Any]:
    return [json.dumps(getattr(r, c)) if c in JSON_COLS else getattr(r, c) for c in USAGE_COLS]
