"""Admin endpoints for teams and keys (admin key only).

- `POST /admin/teams {id, rpm, tpm, max_concurrent, daily_budget_usd, monthly_budget_usd,
  default_tier, weight}` → 201; `GET /admin/teams[/{id}]`; `PUT /admin/teams/{id} {limits…}`
  sets its limits, default tier and share weight, all of them (one left out is none);
  `DELETE /admin/teams/{id}` (revokes its keys).
- `weight`: the team's share of a saturated tier against the other waiting teams'
  (gateway/serving/fair_queue.py), in [0.001, 1000]; null: `[teams.<id>] weight` in gateway.toml
  (default 1). Stored with the team, so every gateway of the store takes it: this one at once
  (the key cache forgets the team), the others within `[server] key_cache_ttl_s`, no restart.
- `PATCH /admin/teams/{id} {field: value…}` changes the fields given only.
- `POST /admin/keys {team_id, name}` → 201 with the secret, shown this once;
  `GET /admin/keys[?team_id=]`; `DELETE /admin/keys/{id}` revokes.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any, Literal

import msgspec
from aiohttp import web

from gateway.accounts.keys import new_key
from gateway.accounts.store.base import Team
from gateway.state import GatewayState
from protocol.openai import APIError

_ENC = msgspec.json.Encoder()
_TEAM_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
#: a team's share weight: the bounds gateway.toml's [teams.<id>] weight has
WEIGHT_MIN, WEIGHT_MAX = 0.001, 1000.0


class TeamLimits(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`PUT /admin/teams/{id}`: a team's limits, all of them (a field left out is its default)."""

    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    daily_budget_usd: float | None = None
    monthly_budget_usd: float | None = None
    default_tier: str = "interactive"
    weight: float | None = None


class TeamCreate(TeamLimits, kw_only=True, forbid_unknown_fields=True):
    """`POST /admin/teams`: a new team's id and its limits."""

    id: str


class TeamPatch(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`PATCH /admin/teams/{id}`: only the fields given change (null: none, or for `weight`
    gateway.toml's)."""

    rpm: int | msgspec.UnsetType | None = msgspec.UNSET
    tpm: int | msgspec.UnsetType | None = msgspec.UNSET
    max_concurrent: int | msgspec.UnsetType | None = msgspec.UNSET
    daily_budget_usd: float | msgspec.UnsetType | None = msgspec.UNSET
    monthly_budget_usd: float | msgspec.UnsetType | None = msgspec.UNSET
    default_tier: str | msgspec.UnsetType = msgspec.UNSET
    weight: float | msgspec.UnsetType | None = msgspec.UNSET


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    team_id: str
    name: str = ""


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_ENC.encode(obj), content_type="application/json")


async def read_body(request: web.Request, cls: type) -> Any:
    try:
        return msgspec.json.decode(await request.read(), type=cls)
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}") from None


#: the tiers a team may default to, by name (the lookup types the name as Team's Literal)
_TIERS: dict[str, Literal["interactive", "batch"]] = {
    "interactive": "interactive",
    "batch": "batch",
}


def validate_team(t: TeamCreate) -> Team:
    if not _TEAM_ID.match(t.id):
        raise APIError(
            400, "team id: 1-64 characters of letters, digits, '_', '.', '-'", param="id"
        )
    for f in ("rpm", "tpm", "max_concurrent", "daily_budget_usd", "monthly_budget_usd"):
        v = getattr(t, f)
        if v is not None and v < 0:
            raise APIError(400, f"{f} must be >= 0", param=f)
    tier = _TIERS.get(t.default_tier)
    if tier is None:
        raise APIError(400, "default_tier must be 'interactive' or 'batch'", param="default_tier")
    w = t.weight
    if w is not None and not (math.isfinite(w) and WEIGHT_MIN <= w <= WEIGHT_MAX):
        raise APIError(
            400, f"weight must be in [{WEIGHT_MIN}, {WEIGHT_MAX:g}] or null", param="weight"
        )
    return Team(
        id=t.id,
        rpm=t.rpm,
        tpm=t.tpm,
        max_concurrent=t.max_concurrent,
        daily_budget_usd=t.daily_budget_usd,
        monthly_budget_usd=t.monthly_budget_usd,
        default_tier=tier,
        weight=w,
        created_at=time.time(),
    )


async def create_team(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    team = validate_team(await read_body(request, TeamCreate))
    return json_response(await state.store.create_team(team), 201)


async def list_teams(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    if "id" in request.match_info:
        team = await state.store.get_team(request.match_info["id"])
        if team is None:
            raise APIError(404, f"no team {request.match_info['id']!r}", code="not_found")
        return json_response(team)
    return json_response({"object": "list", "data": await state.store.list_teams()})


async def update_team(state: GatewayState, request: web.Request) -> web.Response:
    """`PUT /admin/teams/{id}`: the team's limits, default tier and weight, all of them (one
    left out is none). Its keys see the new limits at once on this gateway (the key cache forgets
    the team), within [server] key_cache_ttl_s on others."""
    state.auth.require_admin(request)
    tid = request.match_info["id"]
    body: TeamLimits = await read_body(request, TeamLimits)
    team = validate_team(TeamCreate(id=tid, **msgspec.structs.asdict(body)))
    updated = await state.store.update_team(team)
    if updated is None:
        raise APIError(404, f"no team {tid!r}", code="not_found")
    state.auth.keys.forget_team(tid)
    return json_response(updated)


async def patch_team(state: GatewayState, request: web.Request) -> web.Response:
    """`PATCH /admin/teams/{id}`: the fields given, the others as they are (e.g. `{"weight":
    2}` doubles the team's share of a busy tier). Taken like PUT's: at once on this gateway."""
    state.auth.require_admin(request)
    tid = request.match_info["id"]
    body: TeamPatch = await read_body(request, TeamPatch)
    current = await state.store.get_team(tid)
    if current is None:
        raise APIError(404, f"no team {tid!r}", code="not_found")
    given = {f: v for f in body.__struct_fields__ if (v := getattr(body, f)) is not msgspec.UNSET}
    kept = {f: getattr(current, f) for f in TeamLimits.__struct_fields__}
    team = validate_team(TeamCreate(id=tid, **{**kept, **given}))
    updated = await state.store.update_team(team)
    if updated is None:
        raise APIError(404, f"no team {tid!r}", code="not_found")
    state.auth.keys.forget_team(tid)
    return json_response(updated)


async def delete_team(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    tid = request.match_info["id"]
    if not await state.store.delete_team(tid):
        raise APIError(404, f"no team {tid!r}", code="not_found")
    state.auth.keys.forget_team(tid)
    return json_response({"id": tid, "deleted": True})


async def create_key(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    body: KeyCreate = await read_body(request, KeyCreate)
    key, secret, digest = new_key(body.team_id, body.name)
    await state.store.create_key(key, digest)
    return json_response({**msgspec.structs.asdict(key), "key": secret}, 201)


async def list_keys(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    return json_response(
        {"object": "list", "data": await state.store.list_keys(request.query.get("team_id"))}
    )


async def revoke_key(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    kid = request.match_info["id"]
    if not await state.store.revoke_key(kid):
        raise APIError(404, f"no live key {kid!r}", code="not_found")
    state.auth.keys.forget_key(kid)
    return json_response({"id": kid, "revoked": True})
