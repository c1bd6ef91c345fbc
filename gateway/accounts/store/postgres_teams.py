"""PostgreSQL store: teams and their API keys (PostgresStore's, by concern).

A deleted team's id is tombstoned in the same transaction as its deletion, and a team created
with a tombstoned id is a 409 (team_ids.py says why). A key is created only for a team that
exists, checked in its transaction.
"""

from __future__ import annotations

import time

import asyncpg

from gateway.accounts.store.base import (
    N_TEAM_COLS,
    TEAM_COLS,
    ApiKey,
    StoreError,
    Team,
    team_values,
)
from gateway.accounts.store.postgres_quota import KEY_COLS, key_of, team_of
from gateway.accounts.store.team_ids import reused

#: the teams table's placeholders, one per TEAM_COLS column
_TEAM_VALUES = ",".join(f"${i + 1}" for i in range(N_TEAM_COLS))


class PostgresTeams:
    """Teams and keys on the store's pool (`pool`, PostgresStore's)."""

    @property
    def pool(self) -> asyncpg.Pool:
        raise NotImplementedError

    async def create_team(self, team: Team) -> Team:
        fields = {f: getattr(team, f) for f in team.__struct_fields__}
        t = Team(**{**fields, "created_at": team.created_at or time.time()})
        try:
            async with self.pool.acquire() as con, con.transaction():
                if await con.fetchval("SELECT 1 FROM team_tombstones WHERE id=$1", t.id):
                    raise reused(t.id)
                await con.execute(
                    f"INSERT INTO teams ({TEAM_COLS}) VALUES ({_TEAM_VALUES})",
                    *team_values(t),
                )
        except asyncpg.UniqueViolationError:
            raise StoreError(409, f"team {t.id!r} already exists") from None
        return t

    async def update_team(self, team: Team) -> Team | None:
        r = await self.pool.fetchrow(
            "UPDATE teams SET rpm=$2, tpm=$3, max_concurrent=$4, daily_budget_usd=$5, "
            "monthly_budget_usd=$6, default_tier=$7, weight=$8 WHERE id=$1 "
            f"RETURNING {TEAM_COLS}",
            team.id,
            team.rpm,
            team.tpm,
            team.max_concurrent,
            team.daily_budget_usd,
            team.monthly_budget_usd,
            team.default_tier,
            team.weight,
        )
        return team_of(r) if r else None

    async def get_team(self, team_id: str) -> Team | None:
        r = await self.pool.fetchrow(f"SELECT {TEAM_COLS} FROM teams WHERE id=$1", team_id)
        return team_of(r) if r else None

    async def list_teams(self) -> list[Team]:
        return [
            team_of(r) for r in await self.pool.fetch(f"SELECT {TEAM_COLS} FROM teams ORDER BY id")
        ]

    async def delete_team(self, team_id: str) -> bool:
        async with self.pool.acquire() as con, con.transaction():
            n = await con.execute("DELETE FROM teams WHERE id=$1", team_id)
            if n != "DELETE 0":
                await con.execute(
                    "INSERT INTO team_tombstones (id, deleted_at) VALUES ($1, $2) "
                    "ON CONFLICT DO NOTHING",
                    team_id,
                    time.time(),
                )
            for table in ("team_state", "rate_buckets", "reservations"):
                await con.execute(f"DELETE FROM {table} WHERE team_id=$1", team_id)
            await con.execute(
                "UPDATE api_keys SET revoked_at=$1 WHERE team_id=$2 AND revoked_at IS NULL",
                time.time(),
                team_id,
            )
        return n != "DELETE 0"

    async def create_key(self, key: ApiKey, secret_hash: str) -> ApiKey:
        async with self.pool.acquire() as con, con.transaction():
            if await con.fetchval("SELECT 1 FROM teams WHERE id=$1", key.team_id) is None:
                raise StoreError(404, f"no team {key.team_id!r}")
            await con.execute(
                f"INSERT INTO api_keys ({KEY_COLS}, secret_hash) VALUES ($1,$2,$3,$4,$5,$6,$7)",
                key.id,
                key.team_id,
                key.name,
                key.prefix,
                key.created_at,
                None,
                secret_hash,
            )
        return key

    async def key_by_hash(self, secret_hash: str) -> tuple[ApiKey, Team] | None:
        r = await self.pool.fetchrow(
            "SELECT k.id AS kid, k.team_id, k.name, k.prefix, k.created_at AS kcreated, "
            "k.revoked_at, t.* FROM api_keys k JOIN teams t ON t.id = k.team_id "
            "WHERE k.secret_hash=$1 AND k.revoked_at IS NULL",
            secret_hash,
        )
        if r is None:
            return None
        key = ApiKey(
            id=r["kid"],
            team_id=r["team_id"],
            name=r["name"],
            prefix=r["prefix"],
            created_at=r["kcreated"],
            revoked_at=r["revoked_at"],
        )
        return key, team_of(r)

    async def list_keys(self, team_id: str | None = None) -> list[ApiKey]:
        if team_id:
            rows = await self.pool.fetch(
                f"SELECT {KEY_COLS} FROM api_keys WHERE team_id=$1 ORDER BY created_at", team_id
            )
        else:
            rows = await self.pool.fetch(f"SELECT {KEY_COLS} FROM api_keys ORDER BY created_at")
        return [key_of(r) for r in rows]

    async def revoke_key(self, key_id: str) -> bool:
        n = await self.pool.execute(
            "UPDATE api_keys SET revoked_at=$1 WHERE id=$2 AND revoked_at IS NULL",
            time.time(),
            key_id,
        )
        return n != "UPDATE 0"
