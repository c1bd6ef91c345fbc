"""Failed authentications per client, in a sliding window: the limits that keep guessing and
floods of bogus keys slow.

Two windows use it (gateway/accounts/auth.py): the admin key's (`ADMIN`: 10 failures a minute
per address, then every admin-shaped attempt from there is refused before it is compared) and
the API keys' (`LOOKUPS`: failed key lookups per address; past it an unknown key is refused
before the store is asked, so a flood of random bearer tokens cannot make one store query each).

Invariants: memory is bounded (`max_addresses`, the least recently failing forgotten first);
an address is refused only while `max_failures` of its failures lie inside the window, and
Retry-After says when the oldest leaves it.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from protocol.openai import APIError


@dataclass(frozen=True, kw_only=True)
class Limit:
    max_failures: int
    window_s: float
    #: the 429's error code and words
    code: str
    message: str


ADMIN = Limit(
    max_failures=10,
    window_s=60.0,
    code="admin_auth_rate_limited",
    message="too many failed admin authentications from this address; retry later",
)
LOOKUPS = Limit(
    max_failures=50,
    window_s=10.0,
    code="auth_rate_limited",
    message="too many failed API key authentications from this address; retry later",
)


class FailureWindow:
    """The failures of each client address within `limit.window_s`."""

    def __init__(self, limit: Limit, max_addresses: int = 10_000) -> None:
        self.limit = limit
        self.max_addresses = max_addresses
        self._failures: collections.OrderedDict[str, collections.deque[float]] = (
            collections.OrderedDict()
        )

    def blocked_for(self, address: str, now: float | None = None) -> float | None:
        """Seconds until `address` may try again, or None while it may."""
        now = time.monotonic() if now is None else now
        q = self._failures.get(address)
        while q and q[0] <= now - self.limit.window_s:
            q.popleft()
        if q is not None and len(q) >= self.limit.max_failures:
            return q[0] + self.limit.window_s - now
        return None

    def check(self, address: str, now: float | None = None) -> None:
        """429 while `address` has used up its failures."""
        wait = self.blocked_for(address, now)
        if wait is not None:
            raise APIError(
                429,
                self.limit.message,
                type_="rate_limit_error",
                code=self.limit.code,
                retry_after_s=wait,
            )

    def failed(self, address: str, now: float | None = None) -> None:
        q = self._failures.setdefault(address, collections.deque())
        self._failures.move_to_end(address)
        q.append(time.monotonic() if now is None else now)
        while len(q) > self.limit.max_failures:
            q.popleft()  # only the newest `max_failures` decide: a flood cannot grow a deque
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)
