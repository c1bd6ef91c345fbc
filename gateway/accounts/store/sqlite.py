"""SQLite store (the default): one file in WAL mode, a worker thread and a fast path.

Calls that may wait run on a dedicated worker thread, so the event loop never waits for a
lock or an fsync; the per-request ones (key lookup, reservation, a small usage batch) run on
the loop's own connection when the write lock is free at that moment (sqlite_conn.py says
exactly when). Reservations
use `BEGIN IMMEDIATE`, which takes SQLite's write lock before reading the counters, so the
check-and-book is atomic against every other writer of the file — other gateway processes
on the same machine included. `synchronous=NORMAL` in WAL mode survives a killed process
(what the SIGKILL test checks); a power cut may lose the last transactions.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from gateway.accounts.store.base import (
    WINDOW_S,
    ApiKey,
    Refusal,
    Reservation,
    ReserveRequest,
    Settlement,
    Store,
    StoreError,
    Team,
    UsageRecord,
)
from gateway.accounts.store.expiry import EXPIRED, booked_from, booked_json, expired_record
from gateway.accounts.store.rules import Counters, day_period, decide, month_period, window_start
from gateway.accounts.store.sqlite_conn import Connections
from gateway.accounts.store.usage_totals import outliers_sql, totals_row, totals_sql

T = TypeVar("T")
#: usage batches up to this many records commit on the event loop's fast path
FAST_BATCH = 8

SCHEMA = """
CREATE TABLE IF NOT EXISTS teams (
    id TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, max_concurrent INTEGER,
    daily_budget_usd REAL, monthly_budget_usd REAL, default_tier TEXT NOT NULL,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, name TEXT NOT NULL, prefix TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, key_id TEXT NOT NULL, request_id TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL, tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, gateway_id TEXT, booked TEXT, streamed_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS gateways (id TEXT PRIMARY KEY, heartbeat_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS reservations_expiry ON reservations (expires_at);
CREATE TABLE IF NOT EXISTS team_state (
    team_id TEXT PRIMARY KEY, active INTEGER NOT NULL, active_cost_usd REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rate_buckets (
    team_id TEXT NOT NULL, second INTEGER NOT NULL, requests INTEGER NOT NULL, tokens INTEGER NOT NULL,
    PRIMARY KEY (team_id, second));
CREATE TABLE IF NOT EXISTS spend (
    team_id TEXT NOT NULL, period TEXT NOT NULL, cost_usd REAL NOT NULL,
    PRIMARY KEY (team_id, period));
CREATE TABLE IF NOT EXISTS usage (
    request_id TEXT NOT NULL, team_id TEXT NOT NULL, key_id TEXT NOT NULL,
    model_requested TEXT NOT NULL, model_used TEXT NOT NULL, tier TEXT NOT NULL,
    status TEXT NOT NULL, endpoint TEXT NOT NULL, prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL, cached_tokens INTEGER NOT NULL, cost_usd REAL NOT NULL,
    ttft_s REAL, latency_s REAL NOT NULL, nodes TEXT NOT NULL, created_at REAL NOT NULL, user TEXT,
    migrations INTEGER, leg_tokens TEXT);
CREATE INDEX IF NOT EXISTS usage_team_time ON usage (team_id, created_at);
CREATE TABLE IF NOT EXISTS usage_keys (
    request_id TEXT PRIMARY KEY, team_id TEXT NOT NULL, cost_usd REAL NOT NULL, created_at REAL NOT NULL,
    billed_at REAL NOT NULL);
"""
#: columns later versions added to existing tables: (table, column, type)
ADDED_COLUMNS = [
    ("usage", "user", "TEXT"),
    ("reservations", "gateway_id", "TEXT"),
    ("reservations", "booked", "TEXT"),
    ("usage", "migrations", "INTEGER"),
    ("usage", "leg_tokens", "TEXT"),
    ("reservations", "streamed_tokens", "INTEGER NOT NULL DEFAULT 0"),
]

_TEAM_COLS = (
    "id, rpm, tpm, max_concurrent, daily_budget_usd, monthly_budget_usd, default_tier, created_at"
)
_KEY_COLS = "id, team_id, name, prefix, created_at, revoked_at"
_USAGE_COLS = (
    "request_id",
    "team_id",
    "key_id",
    "model_requested",
    "model_used",
    "tier",
    "status",
    "endpoint",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "cost_usd",
    "ttft_s",
    "latency_s",
    "nodes",
    "created_at",
    "user",
    "migrations",
    "leg_tokens",
)


def _team(row: tuple[Any, ...]) -> Team:
    return Team(
        id=row[0],
        rpm=row[1],
        tpm=row[2],
        max_concurrent=row[3],
        daily_budget_usd=row[4],
        monthly_budget_usd=row[5],
        default_tier=row[6],
        created_at=row[7],
    )


def _key(row: tuple[Any, ...]) -> ApiKey:
    return ApiKey(
        id=row[0], team_id=row[1], name=row[2], prefix=row[3], created_at=row[4], revoked_at=row[5]
    )


def _record(row: tuple[Any, ...]) -> UsageRecord:
    d = dict(zip(_USAGE_COLS, row, strict=True))
    d["nodes"] = json.loads(d["nodes"])
    d["migrations"] = d["migrations"] or 0  # NULL: a record from before stream migration
    d["leg_tokens"] = json.loads(d["leg_tokens"] or "[]")
    return UsageRecord(**d)


def _init(db: sqlite3.Connection) -> None:
    db.executescript(SCHEMA)
    _add_columns(db)
    # Older files had a second index on reservations (team, expiry): every booking and every
    # settlement paid for it, and the expiry index alone serves the per-team expiry check
    # (expired rows are few). A no-op once it is gone.
    db.execute("DROP INDEX IF EXISTS reservations_team_expiry")


class SqliteStore(Store):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._conns = Connections(self.path)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._conns.run(fn)

    async def open(self) -> None:
        await self._conns.open(_init)

    async def close(self) -> None:
        await self._conns.close()

    # --- teams and keys -------------------------------------------------------------------

    async def create_team(self, team: Team) -> Team:
        t = Team(**{**_asdict(team), "created_at": team.created_at or time.time()})

        def q(db: sqlite3.Connection) -> Team:
            try:
                db.execute(
                    f"INSERT INTO teams ({_TEAM_COLS}) VALUES (?,?,?,?,?,?,?,?)",
                    (
                        t.id,
                        t.rpm,
                        t.tpm,
                        t.max_concurrent,
                        t.daily_budget_usd,
                        t.monthly_budget_usd,
                        t.default_tier,
                        t.created_at,
                    ),
                )
            except sqlite3.IntegrityError:
                raise StoreError(409, f"team {t.id!r} already exists") from None
            return t

        return await self._run(q)

    async def update_team(self, team: Team) -> Team | None:
        def q(db: sqlite3.Connection) -> Team | None:
            with _tx(db):
                n = db.execute(
                    "UPDATE teams SET rpm=?, tpm=?, max_concurrent=?, daily_budget_usd=?, "
                    "monthly_budget_usd=?, default_tier=? WHERE id=?",
                    (
                        team.rpm,
                        team.tpm,
                        team.max_concurrent,
                        team.daily_budget_usd,
                        team.monthly_budget_usd,
                        team.default_tier,
                        team.id,
                    ),
                ).rowcount
                row = (
                    db.execute(f"SELECT {_TEAM_COLS} FROM teams WHERE id=?", (team.id,)).fetchone()
                    if n
                    else None
                )
            return _team(row) if row else None

        return await self._run(q)

    async def get_team(self, team_id: str) -> Team | None:
        row = await self._run(
            lambda db: db.execute(
                f"SELECT {_TEAM_COLS} FROM teams WHERE id=?", (team_id,)
            ).fetchone()
        )
        return _team(row) if row else None

    async def list_teams(self) -> list[Team]:
        rows = await self._run(
            lambda db: db.execute(f"SELECT {_TEAM_COLS} FROM teams ORDER BY id").fetchall()
        )
        return [_team(r) for r in rows]

    async def delete_team(self, team_id: str) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            with _tx(db):
                n = db.execute("DELETE FROM teams WHERE id=?", (team_id,)).rowcount
                for table in ("team_state", "rate_buckets", "reservations"):
                    db.execute(f"DELETE FROM {table} WHERE team_id=?", (team_id,))
                db.execute(
                    "UPDATE api_keys SET revoked_at=? WHERE team_id=? AND revoked_at IS NULL",
                    (time.time(), team_id),
                )
            return n > 0

        return await self._run(q)

    async def create_key(self, key: ApiKey, secret_hash: str) -> ApiKey:
        def q(db: sqlite3.Connection) -> ApiKey:
            with _tx(db):
                if db.execute("SELECT 1 FROM teams WHERE id=?", (key.team_id,)).fetchone() is None:
                    raise StoreError(404, f"no team {key.team_id!r}")
                db.execute(
                    f"INSERT INTO api_keys ({_KEY_COLS}, secret_hash) VALUES (?,?,?,?,?,?,?)",
                    (key.id, key.team_id, key.name, key.prefix, key.created_at, None, secret_hash),
                )
            return key

        return await self._run(q)

    async def key_by_hash(self, secret_hash: str) -> tuple[ApiKey, Team] | None:
        cols = (
            ", ".join(f"k.{c.strip()}" for c in _KEY_COLS.split(","))
            + ", "
            + ", ".join(f"t.{c.strip()}" for c in _TEAM_COLS.split(","))
        )
        row = await self._conns.fast(
            lambda db: db.execute(
                f"SELECT {cols} FROM api_keys k JOIN teams t ON t.id = k.team_id "
                "WHERE k.secret_hash=? AND k.revoked_at IS NULL",
                (secret_hash,),
            ).fetchone()
        )
        return (_key(row[:6]), _team(row[6:])) if row else None

    async def list_keys(self, team_id: str | None = None) -> list[ApiKey]:
        sql = (
            f"SELECT {_KEY_COLS} FROM api_keys"
            + (" WHERE team_id=?" if team_id else "")
            + " ORDER BY created_at"
        )
        rows = await self._run(lambda db: db.execute(sql, (team_id,) if team_id else ()).fetchall())
        return [_key(r) for r in rows]

    async def revoke_key(self, key_id: str) -> bool:
        n = await self._run(
            lambda db: (
                db.execute(
                    "UPDATE api_keys SET revoked_at=? WHERE id=? AND revoked_at IS NULL",
                    (time.time(), key_id),
                ).rowcount
            )
        )
        return n > 0

    # --- quotas ---------------------------------------------------------------------------

    async def reserve(self, req: ReserveRequest) -> Reservation | Refusal:
        return await self._conns.fast(lambda db: _reserve(db, req))

    async def settle(self, batch: list[Settlement]) -> None:
        # a few records (a request's own, under light load): the loop's fast path; a big batch
        # on the worker, where its statements run beside the loop instead of stalling it
        q = _settler(batch)
        await (self._conns.fast(q) if len(batch) <= FAST_BATCH else self._run(q))

    def settle_now(self, batch: list[Settlement]) -> bool:
        return len(batch) <= FAST_BATCH and self._conns.now(_settler(batch))[0]

    async def expire_reservations(self, now: float | None = None) -> int:
        t = time.time() if now is None else now

        def q(db: sqlite3.Connection) -> int:
            with _tx(db):
                n = _expire(db, "expires_at<=?", (t,), t)
                db.execute("DELETE FROM rate_buckets WHERE second < ?", (int(t - 2 * WINDOW_S),))
            return n

        return await self._run(q)

    async def heartbeat(
        self,
        gateway_id: str,
        ttl_s: float,
        now: float | None = None,
        streamed: Mapping[str, int] | None = None,
    ) -> None:
        t = time.time() if now is None else now
        counts = [(n, rid, gateway_id) for rid, n in (streamed or {}).items()]

        def q(db: sqlite3.Connection) -> None:
            with _tx(db):
                db.execute(
                    "INSERT INTO gateways (id, heartbeat_at) VALUES (?, ?) ON CONFLICT (id) DO UPDATE "
                    "SET heartbeat_at = excluded.heartbeat_at",
                    (gateway_id, t),
                )
                db.execute(
                    "UPDATE reservations SET expires_at = ? WHERE gateway_id = ? AND expires_at < ?",
                    (t + ttl_s, gateway_id, t + ttl_s),
                )
                # by primary key; max(): a late report never lowers what an earlier one said
                db.executemany(
                    "UPDATE reservations SET streamed_tokens = max(streamed_tokens, ?) "
                    "WHERE id = ? AND gateway_id = ?",
                    counts,
                )

        await self._run(q)

    async def reclaim(self, dead_after_s: float, now: float | None = None) -> int:
        t = time.time() if now is None else now

        def q(db: sqlite3.Connection) -> int:
            with _tx(db):
                dead = [
                    r[0]
                    for r in db.execute(
                        "DELETE FROM gateways WHERE heartbeat_at < ? RETURNING id",
                        (t - dead_after_s,),
                    ).fetchall()
                ]
                return sum(_expire(db, "gateway_id = ?", (g,), t) for g in dead)

        return await self._run(q)

    async def reclaim_previous(
        self, instance: str, gateway_id: str, now: float | None = None
    ) -> int:
        t = time.time() if now is None else now
        prefix = instance + "/"

        def q(db: sqlite3.Connection) -> int:
            with _tx(db):
                # substr, not LIKE: an instance name's '_' would be a wildcard
                db.execute(
                    "DELETE FROM gateways WHERE substr(id, 1, ?) = ? AND id != ?",
                    (len(prefix), prefix, gateway_id),
                )
                return _expire(
                    db,
                    "substr(gateway_id, 1, ?) = ? AND gateway_id != ?",
                    (len(prefix), prefix, gateway_id),
                    t,
                )

        return await self._run(q)

    async def leave(self, gateway_id: str) -> None:
        await self._run(lambda db: db.execute("DELETE FROM gateways WHERE id = ?", (gateway_id,)))

    # --- usage ----------------------------------------------------------------------------

    async def usage(
        self, team_id: str | None, start: float, end: float, group_by: str | None
    ) -> list[dict[str, Any]]:
        keys = {
            None: [],
            "model": [("model_requested", "model")],
            "day": [("date(created_at, 'unixepoch')", "date")],
            "team": [("team_id", "team_id")],
            "tier": [("tier", "tier")],
            "user": [("user", "user")],
        }[group_by]
        where = "created_at >= ? AND created_at < ?" + (" AND team_id = ?" if team_id else "")
        args: tuple[Any, ...] = (start, end, team_id) if team_id else (start, end)
        sql = totals_sql(keys, where, "min", "")  # SQLite orders NULL first
        rows = await self._run(lambda db: db.execute(sql, args).fetchall())
        return [totals_row([name for _, name in keys], r) for r in rows]

    async def usage_records(
        self,
        team_id: str | None,
        start: float,
        end: float,
        after: tuple[float, str] | None = None,
        limit: int | None = None,
    ) -> list[UsageRecord]:
        where = "created_at >= ? AND created_at < ?" + (" AND team_id = ?" if team_id else "")
        args: tuple[Any, ...] = (start, end, team_id) if team_id else (start, end)
        if after is not None:
            where += " AND (created_at > ? OR (created_at = ? AND request_id > ?))"
            args = (*args, after[0], after[0], after[1])
        sql = f"SELECT {', '.join(_USAGE_COLS)} FROM usage WHERE {where} ORDER BY created_at, request_id"
        if limit is not None:
            sql, args = sql + " LIMIT ?", (*args, limit)
        rows = await self._run(lambda db: db.execute(sql, args).fetchall())
        return [_record(r) for r in rows]

    async def usage_outliers(
        self, team_id: str | None, start: float, end: float, limit: int
    ) -> list[UsageRecord]:
        where = "created_at >= ? AND created_at < ?" + (" AND team_id = ?" if team_id else "")
        args: tuple[Any, ...] = (start, end, team_id) if team_id else (start, end)
        sql = outliers_sql(", ".join(f"usage.{c}" for c in _USAGE_COLS), where, "min", "?")
        rows = await self._run(lambda db: db.execute(sql, (*args, *args, limit)).fetchall())
        return [_record(r) for r in rows]


_INSERT_USAGE = (
    f"INSERT INTO usage ({', '.join(_USAGE_COLS)}) VALUES ({', '.join('?' * len(_USAGE_COLS))})"
)
_NODES = _USAGE_COLS.index("nodes")
_LEG_TOKENS = _USAGE_COLS.index("leg_tokens")


def _settler(batch: list[Settlement]) -> Callable[[sqlite3.Connection], None]:
    """The transaction that settles `batch` and writes its usage records (safe to run twice:
    it commits once or not at all)."""

    def q(db: sqlite3.Connection) -> None:
        now = time.time()
        with _tx(db):
            for s in batch:
                _settle_booking(db, s, now)
                _write_usage(db, s.record, now, s.idempotent)

    return q


def _add_columns(db: sqlite3.Connection) -> None:
    """Bring a file an older version created up to `SCHEMA` (which only creates missing tables).

    Under the write lock, so two gateways opening one old file add each column once."""
    with _tx(db):
        for table, column, type_ in ADDED_COLUMNS:
            if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {type_}")


class _tx:
    """BEGIN IMMEDIATE … COMMIT, ROLLBACK on error (autocommit connection)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")


def _asdict(team: Team) -> dict[str, Any]:
    return {f: getattr(team, f) for f in team.__struct_fields__}


#: a team's row, every counter a reservation decides on, and the soonest expiry of any booking
#: (args: window start, team, day period, month period)
_COUNTERS = f"""
SELECT {", ".join("t." + c.strip() for c in _TEAM_COLS.split(","))},
       s.active, s.active_cost_usd, b.n, b.tokens, b.oldest, d.cost_usd, m.cost_usd,
       (SELECT min(expires_at) FROM reservations) AS soonest
FROM teams t
LEFT JOIN team_state s ON s.team_id = t.id
LEFT JOIN (SELECT coalesce(sum(requests), 0) AS n, coalesce(sum(tokens), 0) AS tokens,
                  min(second) AS oldest
           FROM rate_buckets WHERE team_id = ?2 AND second >= ?1) b ON 1
LEFT JOIN spend d ON d.team_id = t.id AND d.period = ?3
LEFT JOIN spend m ON m.team_id = t.id AND m.period = ?4
WHERE t.id = ?2"""


def _reserve(db: sqlite3.Connection, req: ReserveRequest) -> Reservation | Refusal:
    now = req.now
    with _tx(db):
        # Every counter in one query: this transaction is on each request's path to its first
        # token. Lapsed bookings must not count; the query says (from the expiry index) whether
        # there are any, so the common case costs no DELETE that finds nothing.
        args = (window_start(now), req.team_id, day_period(now), month_period(now))
        row = db.execute(_COUNTERS, args).fetchone()
        if row is not None and row[-1] is not None and row[-1] <= now:
            _expire(db, "expires_at<=?", (now,), now)  # every lapsed booking, as the sweeper would
            row = db.execute(_COUNTERS, args).fetchone()
        if row is None:
            raise StoreError(403, f"team {req.team_id!r} no longer exists")
        team = _team(row[:8])
        active, active_cost, n_requests, n_tokens, oldest, spent_day, spent_month = row[8:15]
        c = Counters(
            active=active or 0,
            active_cost=active_cost or 0.0,
            window_requests=n_requests,
            window_tokens=n_tokens,
            window_oldest=float(oldest + 1) if oldest is not None else None,
            spent_day=spent_day or 0.0,
            spent_month=spent_month or 0.0,
        )
        verdict = decide(team, c, req)
        if (
            isinstance(verdict, Refusal) and verdict.kind == "tokens"
        ):  # its Retry-After needs the buckets
            buckets = db.execute(
                "SELECT second, tokens FROM rate_buckets WHERE team_id=? AND second>=? "
                "ORDER BY second",
                (team.id, window_start(now)),
            ).fetchall()
            verdict = decide(team, c, req, [(float(b[0] + 1), b[1]) for b in buckets])
        if isinstance(verdict, Refusal):
            return verdict
        rid = f"rsv-{uuid.uuid4().hex}"
        db.execute(
            "INSERT INTO reservations (id, team_id, key_id, request_id, created_at, expires_at, tokens, "
            "cost_usd, gateway_id, booked) VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                rid,
                team.id,
                req.key_id,
                req.request_id,
                now,
                now + req.ttl_s,
                req.tokens,
                req.cost_usd,
                req.gateway_id or None,
                booked_json(req.booked),
            ),
        )
        db.execute(
            "INSERT INTO team_state (team_id, active, active_cost_usd) VALUES (?, 1, ?) ON CONFLICT (team_id) "
            "DO UPDATE SET active = active + 1, active_cost_usd = active_cost_usd + excluded.active_cost_usd",
            (team.id, req.cost_usd),
        )
        _bucket(db, team.id, int(now), 1, req.tokens)
        return Reservation(rid, verdict)


def _bucket(db: sqlite3.Connection, team_id: str, second: int, requests: int, tokens: int) -> None:
    db.execute(
        "INSERT INTO rate_buckets (team_id, second, requests, tokens) VALUES (?,?,?,?) ON CONFLICT "
        "(team_id, second) DO UPDATE SET requests = requests + excluded.requests, tokens = tokens + excluded.tokens",
        (team_id, second, requests, tokens),
    )


def _unbook(db: sqlite3.Connection, team_id: str, cost: float) -> None:
    """Take a booking whose row the caller deleted out of the in-flight counters (its window
    tokens are the caller's)."""
    db.execute(
        "UPDATE team_state SET active = active - 1, active_cost_usd = CASE WHEN active <= 1 THEN 0 "
        "ELSE active_cost_usd - ? END WHERE team_id=?",
        (cost, team_id),
    )


def _expire(
    db: sqlite3.Connection, where: str, args: tuple[Any, ...], now: float | None = None
) -> int:
    """Bookings whose gateway never settled them stop counting: in flight and in the window;
    each bills its booked prompt and the tokens it had streamed as of its gateway's last
    heartbeat (an `expired` usage record, the day's and month's spend)."""
    now = time.time() if now is None else now
    rows = db.execute(
        f"DELETE FROM reservations WHERE {where} RETURNING team_id, key_id, request_id, created_at, "
        "tokens, cost_usd, booked, streamed_tokens",
        args,
    ).fetchall()
    for team_id, key_id, request_id, created, tokens, cost, booked, streamed in rows:
        _unbook(db, team_id, cost)
        b = booked_from(booked)
        record = expired_record(team_id, key_id, request_id, b, now, streamed)
        # the window keeps what was billed, as a settled request's does (prompt + completion)
        _bucket(
            db,
            team_id,
            int(created),
            0,
            (record.prompt_tokens + record.completion_tokens if record else 0) - tokens,
        )
        if record is not None and b is not None:
            _write_usage(db, record, now, once=b.idempotent)
    return len(rows)


def _write_usage(db: sqlite3.Connection, r: UsageRecord, now: float, once: bool = False) -> None:
    """`once`: r's request id is an idempotency key (base.Settlement.idempotent)."""
    if once and not _take_key(db, r, now):
        return
    if r.cost_usd > 0:  # the day's and the month's spend, in one statement
        db.execute(
            "INSERT INTO spend (team_id, period, cost_usd) VALUES (?1,?2,?4), (?1,?3,?4) "
            "ON CONFLICT (team_id, period) DO UPDATE SET cost_usd = cost_usd + excluded.cost_usd",
            (r.team_id, day_period(now), month_period(now), r.cost_usd),
        )
    values = [getattr(r, c) for c in _USAGE_COLS]
    values[_NODES] = json.dumps(r.nodes)
    values[_LEG_TOKENS] = json.dumps(r.leg_tokens)
    db.execute(_INSERT_USAGE, values)


def _take_key(db: sqlite3.Connection, r: UsageRecord, now: float) -> bool:
    """`r`'s key is billed once (base.Settlement.idempotent): True to write `r` — its key is
    new, or `r` replaces the key's earlier record (that record and its spend are taken back
    here, under the write lock the caller's transaction holds)."""
    old = db.execute(
        "SELECT team_id, cost_usd, created_at, billed_at FROM usage_keys WHERE request_id=?",
        (r.request_id,),
    ).fetchone()
    if old is not None and r.status == EXPIRED:  # a dead run's booking: the key is billed already
        return False
    if old is not None:
        team_id, cost, created, billed = old
        # (team_id, created_at) is the usage table's index: no scan for the old record
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
        "INSERT INTO usage_keys (request_id, team_id, cost_usd, created_at, billed_at) VALUES (?,?,?,?,?) "
        "ON CONFLICT (request_id) DO UPDATE SET team_id=excluded.team_id, cost_usd=excluded.cost_usd, "
        "created_at=excluded.created_at, billed_at=excluded.billed_at",
        (r.request_id, r.team_id, r.cost_usd, r.created_at, now),
    )
    return True


def _settle_booking(db: sqlite3.Connection, s: Settlement, now: float) -> None:
    """The booking's worst case becomes the request's real tokens, in the second it was booked."""
    row = None
    if s.reservation_id is not None:
        row = db.execute(
            "DELETE FROM reservations WHERE id=? RETURNING team_id, created_at, tokens, cost_usd",
            (s.reservation_id,),
        ).fetchone()
    if row is None:  # nothing booked, or it expired meanwhile: the real tokens count from now
        if s.tokens:
            _bucket(db, s.record.team_id, int(now), 0, s.tokens)
        return
    team_id, created, booked, cost = row
    _unbook(db, team_id, cost)
    _bucket(db, team_id, int(created), 0, s.tokens - booked)
