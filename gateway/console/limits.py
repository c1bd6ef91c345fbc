"""The console's request rate: every console request of a signed-in session (a page, the
cluster page's live refresh, a form) counts in that session's sliding 60 s window, and past the
limit it gets 429 with Retry-After, as the API's `rate_limit_exceeded` does.

The limit is the API's for the same key, never looser: a team key's session is held to its
team's requests per minute (`rpm`, read through the key cache, so a limit an admin changes
applies within `[server] key_cache_ttl_s`), and every session to `[server] console_rpm` at most
(the admin key and a team without `rpm` have only that). A page view fans out into several API
calls (the Usage page: four grouped queries), which the console makes on the gateway's own
socket; they do not count again, and the window is the session's own, so browsing does not
spend the team's API requests.

Invariants: a window holds at most `limit` times (older ones leave as they age), lives on its
session (bounded and expiring, session.py), and the clock is monotonic (`clock`, replaceable
in tests so a flood's refusal never depends on how fast the machine is).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gateway.accounts.keys import hash_secret
from gateway.console.session import Session
from gateway.state import GatewayState

WINDOW_S = 60.0


class ConsoleLimit:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock

    async def limit_of(self, state: GatewayState, s: Session) -> int:
        """Requests a minute this session may make (0: no limit)."""
        cap = state.config.server.console_rpm
        if s.admin:
            return cap
        # the key cache: no store read per view; None: revoked (the page's API call says 401)
        found = await state.auth.keys.lookup(hash_secret(s.key))
        rpm = found[1].rpm if found is not None else None
        return min(x for x in (cap, rpm) if x) if (cap or rpm) else 0

    def admit(self, s: Session, limit: int) -> float | None:
        """None: admitted (and counted); else the seconds until the window has room."""
        if not limit:
            return None
        now = self.clock()
        q = s.recent
        while q and q[0] <= now - WINDOW_S:
            q.popleft()
        if len(q) >= limit:
            return max(1.0, math.ceil(q[0] + WINDOW_S - now))
        q.append(now)
        return None
