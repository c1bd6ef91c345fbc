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

import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from gateway.accounts.store.base import (
    N_TEAM_COLS,
    TEAM_COLS,
    USAGE_COLS,
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
    team_values,
)
from gateway.accounts.store.sqlite_batch import SqliteBatchTables, init_batch_tables
from gateway.accounts.store.sqlite_conn import Connections, Immediate
from gateway.accounts.store.sqlite_quota import expire_where, reserve_in, settler
from gateway.accounts.store.sqlite_tables import (
    FAST_BATCH,
    KEY_COLS,
    init_tables,
    key_of,
    team_fields,
    team_of,
)
from gateway.accounts.store.sqlite_usage import record_of
from gateway.accounts.store.team_ids import SQLITE as TOMBSTONES
from gateway.accounts.store.team_ids import reused
from gateway.accounts.store.usage_totals import group_keys, outliers_sql, totals_row, totals_sql

T = TypeVar("T")

#: the teams table's placeholders, one per TEAM_COLS column
_TEAM_VALUES = ",".join("?" * N_TEAM_COLS)


def _init(db: sqlite3.Connection) -> None:
    init_tables(db)
    db.execute(TOMBSTONES)


class SqliteStore(SqliteBatchTables, Store):
    """The one store on SQLite: the accounts' tables in `path`, the batch tier's in
    `batch_path` (default: `batch/batch.sqlite3` beside it, as the gateway's default
    `[batch] data_dir` puts it), both through `Connections`."""

    def __init__(self, path: str | Path, batch_path: str | Path | None = None) -> None:
        self.path = Path(path)
        self._conns = Connections(self.path, _init)
        self.batch_path = (
            Path(batch_path) if batch_path else self.path.parent / "batch" / "batch.sqlite3"
        )
        self._batch = Connections(self.batch_path, init_batch_tables)

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        return await self._conns.run(fn)

    async def open(self) -> None:
        await self._conns.open()

    async def close(self) -> None:
        await self._conns.close()
        await self._batch.close()

    # --- teams and keys -------------------------------------------------------------------

    async def create_team(self, team: Team) -> Team:
        t = Team(**{**team_fields(team), "created_at": team.created_at or time.time()})

        def q(db: sqlite3.Connection) -> Team:
            try:
                with Immediate(db):
                    if db.execute("SELECT 1 FROM team_tombstones WHERE id=?", (t.id,)).fetchone():
                        raise reused(t.id)
                    db.execute(
                        f"INSERT INTO teams ({TEAM_COLS}) VALUES ({_TEAM_VALUES})",
                        team_values(t),
                    )
            except sqlite3.IntegrityError:
                raise StoreError(409, f"team {t.id!r} already exists") from None
            return t

        return await self._run(q)

    async def update_team(self, team: Team) -> Team | None:
        def q(db: sqlite3.Connection) -> Team | None:
            with Immediate(db):
                n = db.execute(
                    "UPDATE teams SET rpm=?, tpm=?, max_concurrent=?, daily_budget_usd=?, "
                    "monthly_budget_usd=?, default_tier=?, weight=? WHERE id=?",
                    (
                        team.rpm,
                        team.tpm,
                        team.max_concurrent,
                        team.daily_budget_usd,
                        team.monthly_budget_usd,
                        team.default_tier,
                        team.weight,
                        team.id,
                    ),
                ).rowcount
                row = (
                    db.execute(f"SELECT {TEAM_COLS} FROM teams WHERE id=?", (team.id,)).fetchone()
                    if n
                    else None
                )
            return team_of(row) if row else None

        return await self._run(q)

    async def get_team(self, team_id: str) -> Team | None:
        row = await self._run(
            lambda db: db.execute(
                f"SELECT {TEAM_COLS} FROM teams WHERE id=?", (team_id,)
            ).fetchone()
        )
        return team_of(row) if row else None

    async def list_teams(self) -> list[Team]:
        rows = await self._run(
            lambda db: db.execute(f"SELECT {TEAM_COLS} FROM teams ORDER BY id").fetchall()
        )
        return [team_of(r) for r in rows]

    async def delete_team(self, team_id: str) -> bool:
        def q(db: sqlite3.Connection) -> bool:
            with Immediate(db):
                n = db.execute("DELETE FROM teams WHERE id=?", (team_id,)).rowcount
                if n:  # its id is never given out again (team_ids.py)
                    db.execute(
                        "INSERT OR IGNORE INTO team_tombstones (id, deleted_at) VALUES (?, ?)",
                        (team_id, time.time()),
                    )
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
            with Immediate(db):
                if db.execute("SELECT 1 FROM teams WHERE id=?", (key.team_id,)).fetchone() is None:
                    raise StoreError(404, f"no team {key.team_id!r}")
                db.execute(
                    f"INSERT INTO api_keys ({KEY_COLS}, secret_hash) VALUES (?,?,?,?,?,?,?)",
                    (key.id, key.team_id, key.name, key.prefix, key.created_at, None, secret_hash),
                )
            return key

        return await self._run(q)

    async def key_by_hash(self, secret_hash: str) -> tuple[ApiKey, Team] | None:
        cols = (
            ", ".join(f"k.{c.strip()}" for c in KEY_COLS.split(","))
            + ", "
            + ", ".join(f"t.{c.strip()}" for c in TEAM_COLS.split(","))
        )
        row = await self._conns.fast(
            lambda db: db.execute(
                f"SELECT {cols} FROM api_keys k JOIN teams t ON t.id = k.team_id "
                "WHERE k.secret_hash=? AND k.revoked_at IS NULL",
                (secret_hash,),
            ).fetchone()
        )
        return (key_of(row[:6]), team_of(row[6:])) if row else None

    async def list_keys(self, team_id: str | None = None) -> list[ApiKey]:
        sql = (
            f"SELECT {KEY_COLS} FROM api_keys"
            + (" WHERE team_id=?" if team_id else "")
            + " ORDER BY created_at"
        )
        rows = await self._run(lambda db: db.execute(sql, (team_id,) if team_id else ()).fetchall())
        return [key_of(r) for r in rows]

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
        return await self._conns.fast(lambda db: reserve_in(db, req))

    async def settle(self, batch: list[Settlement]) -> None:
        # a few records (a request's own, under light load): the loop's fast path; a big batch
        # on the worker, where its statements run beside the loop instead of stalling it
        q = settler(batch)
        await (self._conns.fast(q) if len(batch) <= FAST_BATCH else self._run(q))

    def settle_now(self, batch: list[Settlement]) -> bool:
        return len(batch) <= FAST_BATCH and self._conns.now(settler(batch))[0]

    async def expire_reservations(self, now: float | None = None) -> int:
        def q(db: sqlite3.Connection) -> int:
            with Immediate(db):
                t = time.time() if now is None else now
                n = expire_where(db, "expires_at<=?", (t,), t)
                db.execute("DELETE FROM rate_buckets WHERE second < ?", (int(t - 2 * WINDOW_S),))
            return n

        # the heartbeat's housekeeping: on its lane, so the next beat never waits behind the queue
        return await self._conns.beat(q)

    async def heartbeat(
        self,
        gateway_id: str,
        ttl_s: float,
        now: float | None = None,
        streamed: Mapping[str, int] | None = None,
    ) -> float | None:
        counts = [(n, rid, gateway_id) for rid, n in (streamed or {}).items()]

        def q(db: sqlite3.Connection) -> float | None:
            with Immediate(db):
                # the time the row says is the time it is written (the write lock held), not the
                # time the call was made: a call that waited for the lock or behind a slow one
                # must not write a heartbeat already stale (a reclaim would take it for dead)
                t = time.time() if now is None else now
                prev = db.execute(
                    "SELECT heartbeat_at FROM gateways WHERE id = ?", (gateway_id,)
                ).fetchone()
                db.execute(
                    "INSERT INTO gateways (id, heartbeat_at) VALUES (?, ?) ON CONFLICT (id) DO "
                    "UPDATE SET heartbeat_at = excluded.heartbeat_at",
                    (gateway_id, t),
                )
                db.execute(
                    "UPDATE reservations SET expires_at = ? WHERE gateway_id = ? "
                    "AND expires_at < ?",
                    (t + ttl_s, gateway_id, t + ttl_s),
                )
                # by primary key; max(): a late report never lowers what an earlier one said
                db.executemany(
                    "UPDATE reservations SET streamed_tokens = max(streamed_tokens, ?) "
                    "WHERE id = ? AND gateway_id = ?",
                    counts,
                )
            return None if prev is None else t - prev[0]

        return await self._conns.beat(q)

    async def reclaim(
        self, dead_after_s: float, now: float | None = None, gateway_id: str | None = None
    ) -> int:
        def q(db: sqlite3.Connection) -> int:
            with Immediate(db):
                t = time.time() if now is None else now  # when it runs, as the heartbeat's
                dead = [
                    r[0]
                    for r in db.execute(
                        "DELETE FROM gateways WHERE heartbeat_at < ? AND id != ? RETURNING id",
                        (t - dead_after_s, gateway_id or ""),
                    ).fetchall()
                ]
                return sum(expire_where(db, "gateway_id = ?", (g,), t) for g in dead)

        return await self._conns.beat(q)

    async def reclaim_previous(
        self, instance: str, gateway_id: str, now: float | None = None
    ) -> int:
        t = time.time() if now is None else now
        prefix = instance + "/"

        def q(db: sqlite3.Connection) -> int:
            with Immediate(db):
                # substr, not LIKE: an instance name's '_' would be a wildcard
                db.execute(
                    "DELETE FROM gateways WHERE substr(id, 1, ?) = ? AND id != ?",
                    (len(prefix), prefix, gateway_id),
                )
                return expire_where(
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
        keys = group_keys(group_by, "date(created_at, 'unixepoch')", "user")
        where = "created_at >= ? AND created_at < ?" + (" AND team_id = ?" if team_id else "")
        args: tuple[Any, ...] = (start, end, team_id) if team_id else (start, end)
        sql = totals_sql(keys, where, "min", "")  # SQLite orders NULL first
        rows = await self._conns.report(lambda db: db.execute(sql, args).fetchall())
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
        sql = (
            f"SELECT {', '.join(USAGE_COLS)} FROM usage WHERE {where} "
            "ORDER BY created_at, request_id"
        )
        if limit is not None:
            sql, args = sql + " LIMIT ?", (*args, limit)
        # converted in the worker: decoding a page's JSON columns on the event loop stalls every
        # stream of every team for as long
        return await self._conns.report(lambda db: [record_of(r) for r in db.execute(sql, args)])

    async def usage_outliers(
        self, team_id: str | None, start: float, end: float, limit: int
    ) -> list[UsageRecord]:
        where = "created_at >= ? AND created_at < ?" + (" AND team_id = ?" if team_id else "")
        args: tuple[Any, ...] = (start, end, team_id) if team_id else (start, end)
        sql = outliers_sql(", ".join(f"usage.{c}" for c in USAGE_COLS), where, "min", "?")
        return await self._conns.report(
            lambda db: [record_of(r) for r in db.execute(sql, (*args, *args, limit))]
        )
