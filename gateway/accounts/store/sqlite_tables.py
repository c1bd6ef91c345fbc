"""The SQLite store's tables of keys, teams, quotas and usage: their schema (with the columns
later versions added, each added when a file is opened) and the row mappers. The transactions
on them are sqlite_quota.py's.
"""

from __future__ import annotations

import sqlite3
from typing import Any

from gateway.accounts.store.base import ApiKey, Team
from gateway.accounts.store.sqlite_conn import Immediate

#: usage batches up to this many records commit on the event loop's fast path
FAST_BATCH = 8

SCHEMA = """
CREATE TABLE IF NOT EXISTS teams (
    id TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, max_concurrent INTEGER,
    daily_budget_usd REAL, monthly_budget_usd REAL, default_tier TEXT NOT NULL,
    created_at REAL NOT NULL, weight REAL);
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, name TEXT NOT NULL, prefix TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE, created_at REAL NOT NULL, revoked_at REAL);
CREATE TABLE IF NOT EXISTS reservations (
    id TEXT PRIMARY KEY, team_id TEXT NOT NULL, key_id TEXT NOT NULL, request_id TEXT NOT NULL,
    created_at REAL NOT NULL, expires_at REAL NOT NULL, tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL, gateway_id TEXT, booked TEXT,
    streamed_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS gateways (id TEXT PRIMARY KEY, heartbeat_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS reservations_expiry ON reservations (expires_at);
CREATE TABLE IF NOT EXISTS team_state (
    team_id TEXT PRIMARY KEY, active INTEGER NOT NULL, active_cost_usd REAL NOT NULL);
CREATE TABLE IF NOT EXISTS rate_buckets (
    team_id TEXT NOT NULL, second INTEGER NOT NULL, requests INTEGER NOT NULL,
    tokens INTEGER NOT NULL,
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
    request_id TEXT PRIMARY KEY, team_id TEXT NOT NULL, cost_usd REAL NOT NULL,
    created_at REAL NOT NULL,
    billed_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS usage_keys_billed ON usage_keys (billed_at);
"""
#: columns later versions added to existing tables: (table, column, type)
ADDED_COLUMNS = [
    ("usage", "user", "TEXT"),
    ("reservations", "gateway_id", "TEXT"),
    ("reservations", "booked", "TEXT"),
    ("usage", "migrations", "INTEGER"),
    ("usage", "leg_tokens", "TEXT"),
    ("reservations", "streamed_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("usage", "queue_s", "REAL"),
    ("usage", "adapter", "TEXT"),
    ("usage", "version", "TEXT"),
    ("usage", "cache_write_tokens", "INTEGER"),
    ("teams", "weight", "REAL"),
]

KEY_COLS = "id, team_id, name, prefix, created_at, revoked_at"


def team_of(row: tuple[Any, ...]) -> Team:
    return Team(
        id=row[0],
        rpm=row[1],
        tpm=row[2],
        max_concurrent=row[3],
        daily_budget_usd=row[4],
        monthly_budget_usd=row[5],
        default_tier=row[6],
        created_at=row[7],
        weight=row[8],
    )


def key_of(row: tuple[Any, ...]) -> ApiKey:
    return ApiKey(
        id=row[0], team_id=row[1], name=row[2], prefix=row[3], created_at=row[4], revoked_at=row[5]
    )


def init_tables(db: sqlite3.Connection) -> None:
    db.executescript(SCHEMA)
    _add_columns(db)
    # Older files had a second index on reservations (team, expiry): every booking and every
    # settlement paid for it, and the expiry index alone serves the per-team expiry check
    # (expired rows are few). A no-op once it is gone.
    db.execute("DROP INDEX IF EXISTS reservations_team_expiry")


def _add_columns(db: sqlite3.Connection) -> None:
    """Bring a file an older version created up to `SCHEMA` (which only creates missing tables).

    Under the write lock, so two gateways opening one old file add each column once."""
    with Immediate(db):
        for table, column, type_ in ADDED_COLUMNS:
            if column not in {row[1] for row in db.execute(f"PRAGMA table_info({table})")}:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {type_}")


def team_fields(team: Team) -> dict[str, Any]:
    return {f: getattr(team, f) for f in team.__struct_fields__}
