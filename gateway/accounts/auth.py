"""Who is calling: `Authorization: Bearer sk-duet-…` → (key, team), or the admin key.

401 for a missing, unknown or revoked key (the message never says which of the last two);
403 is for a valid key asking for another team's data (checked by the handlers). An address
that fails the admin key `AdminGuard.MAX_FAILURES` times within `WINDOW_S` is refused (429 +
Retry-After) until the oldest failure leaves the window: the admin key cannot be guessed at
line rate. The admin key itself is at least `MIN_ADMIN_KEY` characters (checked at start-up).
"""

from __future__ import annotations

import collections
import time

from aiohttp import web

from gateway.accounts.key_cache import Found, KeyCache
from gateway.accounts.keys import hash_secret, same_secret
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


class AdminGuard:
    """Failed admin authentications per client address, in a sliding window."""

    MAX_FAILURES = 10
    WINDOW_S = 60.0
    #: addresses tracked at most (the oldest is forgotten first): memory stays bounded
    MAX_ADDRESSES = 10_000

    def __init__(self) -> None:
        self._failures: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )

    def check(self, address: str, now: float | None = None) -> None:
        """429 while `address` has used up its failures."""
        now = time.monotonic() if now is None else now
        q = self._failures.get(address)
        while q and q[0] <= now - self.WINDOW_S:
            q.popleft()
        if q is not None and len(q) >= self.MAX_FAILURES:
            raise APIError(
                429,
                "too many failed admin authentications from this address; retry later",
                type_="rate_limit_error",
                code="admin_auth_rate_limited",
                retry_after_s=q[0] + self.WINDOW_S - now,
            )

    def failed(self, address: str, now: float | None = None) -> None:
        q = self._failures.setdefault(address, collections.deque())
        self._failures.move_to_end(address)
        q.append(time.monotonic() if now is None else now)
        while len(self._failures) > self.MAX_ADDRESSES:
            self._failures.popitem(last=False)


class Auth:
    """Who is calling, for every handler: API keys through the key cache, the admin key (the
    config's: `$DUET_ADMIN_KEY`, else its sha256 in [server]), and the per-address guard on
    failed admin attempts."""

    def __init__(self, keys: KeyCache, config: GatewayConfig) -> None:
        self.keys = keys
        self.config = config
        #: failed admin authentications per address
        self.guard = AdminGuard()

    def is_admin(self, token: str) -> bool:
        admin = self.config.admin_key
        if admin:
            return same_secret(token, hash_secret(admin))
        expected = self.config.server.admin_key_sha256
        return bool(expected) and same_secret(token, (expected or "").lower())

    def require_admin(self, request: web.Request) -> None:
        address = request.remote or ""
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
        the admin key, else the key's team. A token that is neither counts as a failed admin
        attempt (the same per-address limit as the admin endpoints), so guessing the admin key
        here is no cheaper than on /admin."""
        address = request.remote or ""
        self.guard.check(address)
        if self.is_admin(bearer(request)):
            return None
        try:
            return (await self.authenticate(request))[1]
        except APIError:
            self.guard.failed(address)
            raise

    async def authenticate(self, request: web.Request, token: str | None = None) -> Found:
        """The key's (key, team); `token`: the key as the caller sent it (default: the bearer
        token; Anthropic's clients send `x-api-key`)."""
        found = await self.keys.lookup(hash_secret(bearer(request) if token is None else token))
        if found is None:
            raise APIError(
                401,
                "invalid API key (unknown or revoked)",
                type_="authentication_error",
                code="invalid_api_key",
            )
        return found
