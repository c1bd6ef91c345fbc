"""Team ids are never reused: a deleted team's id is tombstoned, and creating a team with it is
a 409.

A team's id keys everything it leaves behind: its usage records (with their `user` ids), its
spend, its batch files and results (prompts and outputs), and its prefix-cache domain
(`team:<id>`). Deleting a team revokes its keys and drops its live state, but keeps that
history for the operator's accounts; a new customer given the same id would otherwise inherit
all of it. The tombstone holds only the id and when it was deleted.
"""

from __future__ import annotations

from gateway.accounts.store.base import StoreError

SQLITE = (
    "CREATE TABLE IF NOT EXISTS team_tombstones (id TEXT PRIMARY KEY, deleted_at REAL NOT NULL)"
)
POSTGRES = (
    "CREATE TABLE IF NOT EXISTS team_tombstones "
    "(id TEXT PRIMARY KEY, deleted_at DOUBLE PRECISION NOT NULL)"
)


def reused(team_id: str) -> StoreError:
    return StoreError(
        409,
        f"team id {team_id!r} belonged to a deleted team and is never given out again (its "
        "usage, files, batches and cache domain keep it): choose another id",
    )
