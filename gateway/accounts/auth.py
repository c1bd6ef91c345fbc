"""Who is calling: `Authorization: Bearer sk-duet-…` → (key, team), or the admin key.

401 for a missing, unknown or revoked key (the message never says which of the last two);
403 is for a valid key asking for another team's data (checked by the handlers). An address
that fails the admin key 10 times a minute is refused (429 + Retry-After) until the oldest
failure leaves the window: the admin key cannot be guessed at line rate. An address past its
failed key lookups is refused before the store is asked (auth_guard.py has both limits). The
address is the real client's (client_address.py): the console's own calls and a trusted
proxy's name it. The admin key itself is at least `MIN_ADMIN_KEY` characters (checked at
start-up).
"""

from __future__ import annotations

from aiohttp import web

from gateway.accounts.auth_guard import ADMIN, LOOKUPS, FailureWindow
from gateway.accounts.client_address import ClientAddress
from gateway.accounts.key_cache import Found, KeyCache
from gateway.accounts.keys import PREFIX, hash_secret, same_secret
from gateway.accounts.store.base import Team
from gateway.config import GatewayConfig
from protocol.openai import APIError


def bearer(request: web.Request) -> str:
    h = request.headers.get("Authorization", "")
    scheme, _, token = h.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "missing API key: send `Authorization: Bearer <key>`",
            type_="authentication_error",
            code="missing_api_key",
        )
    return token.strip()


#: the shortest admin key a gateway starts with (a shorter one can be guessed)
MIN_ADMIN_KEY = 32


def _invalid() -> APIError:
    return APIError(
        401,
        "invalid API key (unknown or revoked)",
        type_="authentication_error",
        code="invalid_api_key",
    )


class Auth:
    """Who is calling, for every handler: API keys through the key cache, the admin key (the
    config's: `$DUET_ADMIN_KEY`, else its sha256 in [server]), and the per-address limits on
    failed attempts, counted under the real client's address (client_address.py)."""

    def __init__(self, keys: KeyCache, config: GatewayConfig) -> None:
        self.keys = keys
        self.config = config
        #: failed admin authentications per address
        self.guard = FailureWindow(ADMIN)
        #: failed API key lookups per address
        self.lookups = FailureWindow(LOOKUPS)
        self.clients = ClientAddress(config.server.trusted_proxies)

    def client(self, request: web.Request) -> str:
        """The address `request`'s failed authentications count under."""
        return self.clients.of(request)

    def is_admin(self, token: str) -> bool:
        admin = self.config.admin_key
        if admin:
            return same_secret(token, hash_secret(admin))
        expected = self.config.server.admin_key_sha256
        return bool(expected) and same_secret(token, (expected or "").lower())

    def require_admin(self, request: web.Request) -> None:
        address = self.client(request)
        self.guard.check(address)
        if not self.is_admin(bearer(request)):
            self.guard.failed(address)
            raise APIError(
                401,
                "this endpoint needs the admin key",
                type_="authentication_error",
                code="invalid_api_key",
            )

    async def admin_or_team(self, request: web.Request) -> Team | None:
        """For endpoints the admin and team keys both read (`/v1/models`, `/v1/usage`): None for
        the admin key, else the key's team. A token shaped like a team key is looked up first
        (a valid one is never held by the admin guard: junk from an address many clients share
        must not lock their keys out); a token of any other shape counts, when it is not the
        admin key, as a failed admin attempt (the admin endpoints' limit), so guessing the admin
        key here is no cheaper than on /admin."""
        token = bearer(request)
        address = self.client(request)
        if token.startswith(PREFIX):
            found = await self._lookup(token, address)
            if found is not None:
                return found[1]
            self.guard.check(address)
            if self.is_admin(token):  # an operator's admin key may look like a team key
                return None
            raise _invalid()
        self.guard.check(address)
        if self.is_admin(token):
            return None
        self.guard.failed(address)
        raise _invalid()

    async def authenticate(self, request: web.Request, token: str | None = None) -> Found:
        """The key's (key, team); `token`: the key as the caller sent it (default: the bearer
        token; Anthropic's clients send `x-api-key`)."""
        found = await self._lookup(
            bearer(request) if token is None else token, self.client(request)
        )
        if found is None:
            raise _invalid()
        return found

    async def _lookup(self, token: str, address: str) -> Found | None:
        """The key's (key, team), or None. A key this gateway found lately is answered from
        memory whatever the address did; any other lookup is refused (429) while its address
        is past its failed lookups, before the store is asked."""
        secret_hash = hash_secret(token)
        found = self.keys.cached(secret_hash)
        if found is not None:
            return found
        self.lookups.check(address)
        found = await self.keys.lookup(secret_hash)
        if found is None:
            self.lookups.failed(address)
        return found
