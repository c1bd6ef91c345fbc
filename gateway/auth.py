"""Who is calling: `Authorization: Bearer sk-duet-…` → (key, team), or the admin key.

401 for a missing, unknown or revoked key (the message never says which of the last two);
403 is for a valid key asking for another team's data (checked by the handlers).
"""

from __future__ import annotations

from aiohttp import web

from gateway.keys import hash_secret, same_secret
from gateway.state import GatewayState
from gateway.store.base import ApiKey, Team
from protocol.openai import APIError


def bearer(request: web.Request) -> str:
    h = request.headers.get("Authorization", "")
    scheme, _, token = h.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(401, "missing API key: send `Authorization: Bearer <key>`",
                       type_="authentication_error", code="missing_api_key")  # fmt: skip
    return token.strip()


def is_admin(state: GatewayState, token: str) -> bool:
    admin = state.config.admin_key
    if admin:
        return same_secret(token, hash_secret(admin))
    expected = state.config.server.admin_key_sha256
    return bool(expected) and same_secret(token, expected.lower())


def require_admin(state: GatewayState, request: web.Request) -> None:
    if not is_admin(state, bearer(request)):
        raise APIError(401, "this endpoint needs the admin key", type_="authentication_error",
                       code="invalid_api_key")  # fmt: skip


async def authenticate(state: GatewayState, request: web.Request) -> tuple[ApiKey, Team]:
    found = await state.keys.lookup(hash_secret(bearer(request)))
    if found is None:
        raise APIError(401, "invalid API key (unknown or revoked)", type_="authentication_error",
                       code="invalid_api_key")  # fmt: skip
    return found
