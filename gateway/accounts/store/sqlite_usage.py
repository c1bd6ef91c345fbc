"""The SQLite store's usage records: their columns, the row mapper, and the write of one record
with its spend — under its key when it has one (usage_keys.py decides what a second record of a
key does; this carries it out inside the caller's transaction, under its write lock)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import msgspec

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

_INSERT_USAGE = (
    f"INSERT INTO usage ({', '.join(USAGE_COLS)}) VALUES ({', '.join('?' * len(USAGE_COLS))})"
)
_PRUNE = PRUNE_SQL.format(lock="")
_NODES = USAGE_COLS.index("nodes")
_LEG_TOKENS = USAGE_COLS.index("leg_tokens")
#: the JSON columns' text: msgspec writes a short list in 0.1 µs, json.dumps in 1.7
_JSON = msgspec.json.Encoder()


def record_of(row: tuple[Any, ...]) -> UsageRecord:
    d = dict(zip(USAGE_COLS, row, strict=True))
    d["nodes"] = json.loads(d["nodes"])
    d["migrations"] = d["migrations"] or 0  # NULL: a record from before stream migration
    d["leg_tokens"] = json.loads(d["leg_tokens"] or "[]")
    d["cache_write_tokens"] = d["cache_write_tokens"] or 0  # NULL: from before the column
    return UsageRecord(**d)


def write_usage(
    db: sqlite3.Connection, r: UsageRecord, now: float, key: UsageKey = UsageKey.NONE
) -> None:
    """Write `r` and add its cost to the day's and the month's spend; `key`: how r's request
    id is a usage key (base.Settlement.key)."""
    if key is not UsageKey.NONE and not take_key(db, r, now, key):
        return
    if r.cost_usd > 0:  # the day's and the month's spend, in one statement
        db.execute(
            "INSERT INTO spend (team_id, period, cost_usd) VALUES (?1,?2,?4), (?1,?3,?4) "
            "ON CONFLICT (team_id, period) DO UPDATE SET cost_usd = cost_usd + excluded.cost_usd",
            (r.team_id, day_period(now), month_period(now), r.cost_usd),
        )
    values = [getattr(r, c) for c in USAGE_COLS]
    values[_NODES] = _JSON.encode(r.nodes).decode()
    values[_LEG_TOKENS] = _JSON.encode(r.leg_tokens).decode()
    db.execute(_INSERT_USAGE, values)


def take_key(db: sqlite3.Connection, r: UsageRecord, now: float, key: UsageKey) -> bool:
    """True to write `r` under its key (usage_keys.verdict): the key is new, or `r` replaces
    the key's earlier record (taken back here with its spend), or is billed beside it."""
    old = db.execute(
        "SELECT team_id, cost_usd, created_at, billed_at FROM usage_keys WHERE request_id=?",
        (r.request_id,),
    ).fetchone()
    earlier = None
    if old is not None:
        team_id, cost, created, billed = old
        status = None
        if needs_status(key, r.status):
            # (team_id, created_at) is the usage table's index: no scan for the old record
            found = db.execute(
                "SELECT status FROM usage WHERE team_id=? AND created_at=? AND request_id=?",
                (team_id, created, r.request_id),
            ).fetchone()
            status = found[0] if found else None
        earlier = Earlier(team_id=team_id, billed_at=billed, status=status)
    v = verdict(key, r.team_id, r.status, earlier, now)
    if v is Verdict.SKIP:
        return False
    if v is Verdict.REPLACE:
        db.execute(
            "DELETE FROM usage WHERE team_id=? AND created_at=? AND request_id=?",
            (team_id, created, r.request_id),
        )
        if cost > 0:
            db.execute(
                "UPDATE spend SET cost_usd = cost_usd - ? WHERE team_id=? AND period IN (?, ?)",
                (cost, team_id, day_period(billed), month_period(billed)),
            )
    db.execute(
        "INSERT INTO usage_keys (request_id, team_id, cost_usd, created_at, billed_at) "
        "VALUES (?,?,?,?,?) ON CONFLICT (request_id) DO UPDATE SET team_id=excluded.team_id, "
        "cost_usd=excluded.cost_usd, created_at=excluded.created_at, "
        "billed_at=excluded.billed_at",
        (r.request_id, r.team_id, r.cost_usd, r.created_at, now),
    )
    db.execute(_PRUNE, (now - RETAIN_S, PRUNE_PER_WRITE))
    return True
