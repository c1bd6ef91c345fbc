"""Console sign-in: server-side sessions, their cookie, and the CSRF token of each.

A session holds the key it signed in with (the admin key, or one team's key) in this process's
memory only: the browser gets an opaque random id in an HttpOnly, SameSite=Strict cookie
(Secure over HTTPS), never the key, and no secret ever sits in a URL. Each session has its own
CSRF token, required on every POST (a form field or the X-CSRF-Token header) and compared in
constant time; the sign-in form, before any session exists, uses a double-submit token (a
cookie and a form field that must match).

Invariants: bounded (the oldest session goes past MAX_SESSIONS), at most MAX_PER_KEY sessions
per key (signing in once more ends that key's oldest session: one key signing in in a loop
cannot push other keys' sessions out), expiring (TTL_S), and a session that fails the API's
authentication (its key revoked) is dropped by the caller. Cookies are Secure when the request
came over HTTPS: on this socket, through a trusted proxy that says so in X-Forwarded-Proto, or
always with `[server] secure_cookies`.
Sessions are per gateway process: behind a load balancer, pin the console to one gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from aiohttp import web

COOKIE = "duet_console"
#: the sign-in form's double-submit token (before any session exists)
LOGIN_COOKIE = "duet_console_login"
TTL_S = 8 * 3600.0
MAX_SESSIONS = 10_000
#: sessions one key holds at once at most (a person's browsers and tabs, with room to spare)
MAX_PER_KEY = 16


@dataclass
class Session:
    sid: str
    #: the key signed in with; only ever sent to this gateway's own API
    key: str
    #: the team a team key belongs to; None: the admin key (every team)
    team_id: str | None
    csrf: str
    expires: float
    #: monotonic times of this session's recent console requests (limits.py's window)
    recent: deque[float] = field(default_factory=deque)

    @property
    def admin(self) -> bool:
        return self.team_id is None


class Sessions:
    def __init__(self) -> None:
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        #: each key's sessions, oldest first (by the key's hash: no second copy of a secret)
        self._by_key: dict[str, OrderedDict[str, None]] = {}

    def new(self, key: str, team_id: str | None) -> Session:
        s = Session(
            sid=secrets.token_urlsafe(32),
            key=key,
            team_id=team_id,
            csrf=secrets.token_urlsafe(32),
            expires=time.time() + TTL_S,
        )
        self._by_id[s.sid] = s
        mine = self._by_key.setdefault(_digest(key), OrderedDict())
        mine[s.sid] = None
        while len(mine) > MAX_PER_KEY:
            self.drop(next(iter(mine)))
        while len(self._by_id) > MAX_SESSIONS:
            self.drop(next(iter(self._by_id)))
        return s

    def get(self, request: web.Request) -> Session | None:
        sid = request.cookies.get(COOKIE)
        s = self._by_id.get(sid) if sid else None
        if s is not None and s.expires < time.time():
            self.drop(s.sid)
            return None
        return s

    def drop(self, sid: str) -> None:
        s = self._by_id.pop(sid, None)
        if s is None:
            return
        digest = _digest(s.key)
        mine = self._by_key.get(digest)
        if mine is not None:
            mine.pop(sid, None)
            if not mine:
                del self._by_key[digest]

    def of_key(self, key: str) -> int:
        """How many sessions `key` holds."""
        return len(self._by_key.get(_digest(key), ()))


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def same(a: str | None, b: str) -> bool:
    return a is not None and hmac.compare_digest(a.encode(), b.encode())


def set_cookie(
    resp: web.StreamResponse, name: str, value: str, max_age: float, secure: bool
) -> None:
    resp.set_cookie(
        name,
        value,
        max_age=int(max_age),
        path="/console",
        httponly=True,
        samesite="Strict",
        secure=secure,
    )
