"""The operator console at `/console`, served by the gateway.

Server-rendered HTML, one small script and one stylesheet from this package (static/), charts
as inline SVG (charts.py): nothing from a CDN, so it works on offline machines. Sign in with
the admin key (every page, every team) or a team key (that team's usage, batches and requests
only: the console asks the API with that key, and the API scopes it). Sessions, their cookie
and CSRF: session.py. Pages: pages/, one module per page.

Protected like the API: no page without a session; every POST needs the session's CSRF token;
a strict CSP and no-store on every page; keys never in a URL; a failed sign-in counts against
the same per-address limit as a failed admin call (gateway/accounts/auth.py::AdminGuard); a
session's requests are held to its key's requests per minute (limits.py).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.console.api import ApiFailed, call
from gateway.console.limits import ConsoleLimit
from gateway.console.pages import batches, cluster, requests, teams, usage
from gateway.console.render import HEADERS, esc, notice, page
from gateway.console.session import COOKIE, LOGIN_COOKIE, TTL_S, Session, Sessions, same, set_cookie
from gateway.state import GatewayState
from protocol.openai import APIError

SESSIONS = web.AppKey("console_sessions", Sessions)
LIMIT = web.AppKey("console_limit", ConsoleLimit)
STATIC = Path(__file__).parent / "static"
_TYPES = {".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}
#: the static files, by name (nothing else under static/ is served: no path from a URL is opened)
_FILES = {p.name: p for p in STATIC.iterdir() if p.suffix in _TYPES} if STATIC.is_dir() else {}

View = Callable[[GatewayState, web.Request, Session], Awaitable[web.StreamResponse]]
Action = Callable[[GatewayState, web.Request, Session, Any], Awaitable[web.Response]]


def _redirect(to: str) -> web.Response:
    return web.Response(status=303, headers={"Location": to, **HEADERS})


def install(app: web.Application, state_key: web.AppKey[GatewayState]) -> None:
    app[SESSIONS] = Sessions()
    app[LIMIT] = limit = ConsoleLimit()

    async def too_many(state: GatewayState, s: Session, active: str) -> web.Response | None:
        """The 429 page when the session is past its rate (limits.py), else None (counted)."""
        n = await limit.limit_of(state, s)
        wait = limit.admit(s, n)
        if wait is None:
            return None
        resp = page(
            "Too many requests",
            active,
            notice(
                f"Too many requests: this session may make {n} a minute "
                f"(the API's limit for its key). Retry in {wait:.0f} s.",
                "error",
            ),
            s,
            429,
        )
        resp.headers["Retry-After"] = f"{wait:.0f}"
        return resp

    def session_of(request: web.Request) -> tuple[GatewayState, Sessions, Session | None]:
        sessions = request.app[SESSIONS]
        return request.app[state_key], sessions, sessions.get(request)

    async def failed(sessions: Sessions, s: Session, e: ApiFailed, active: str) -> web.Response:
        if e.status == 401:  # the key was revoked or the admin key changed: sign in again
            sessions.drop(s.sid)
            return _redirect("/console/login?expired=1")
        return page(
            "Error",
            active,
            notice(f"The API refused: {e.message} (HTTP {e.status})", "error"),
            s,
            e.status if 400 <= e.status < 600 else 502,
        )

    def view(
        fn: View, active: str, admin: bool = False
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def h(request: web.Request) -> web.StreamResponse:
            state, sessions, s = session_of(request)
            if s is None:
                return _redirect("/console/login")
            if (refused := await too_many(state, s, active)) is not None:
                return refused
            if admin and not s.admin:
                return page(
                    "Admin only", active, notice("This page needs the admin key.", "error"), s, 403
                )
            try:
                return await fn(state, request, s)
            except ApiFailed as e:
                return await failed(sessions, s, e, active)

        return h

    def action(
        fn: Action, active: str, admin: bool = False
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def h(request: web.Request) -> web.StreamResponse:
            state, sessions, s = session_of(request)
            if s is None:
                return page("Sign in", "", notice("Sign in first.", "error"), None, 401)
            if (refused := await too_many(state, s, active)) is not None:
                return refused
            form = await request.post()
            token = request.headers.get("X-CSRF-Token") or form.get("csrf")
            if not same(token if isinstance(token, str) else None, s.csrf):
                return page(
                    "Refused",
                    active,
                    notice(
                        "Refused: the form's CSRF token is missing or wrong. Reload "
                        "the page and try again.",
                        "error",
                    ),
                    s,
                    403,
                )
            if admin and not s.admin:
                return page(
                    "Admin only", active, notice("This needs the admin key.", "error"), s, 403
                )
            try:
                return await fn(state, request, s, form)
            except ApiFailed as e:
                return await failed(sessions, s, e, active)

        return h

    r = app.router
    r.add_get("/console", _index(session_of))
    r.add_get("/console/", _index(session_of))
    r.add_get("/console/login", _login_form(session_of))
    r.add_post("/console/login", _login(session_of))
    r.add_post("/console/logout", action(_logout(app), ""))
    r.add_get("/console/cluster", view(cluster.cluster, "cluster", admin=True))
    r.add_get("/console/teams", view(teams.teams, "teams"))
    r.add_post("/console/teams", action(teams.create_team, "teams", admin=True))
    r.add_post("/console/teams/limits", action(teams.set_limits, "teams", admin=True))
    r.add_post("/console/keys", action(teams.create_key, "teams", admin=True))
    r.add_post("/console/keys/{id}/revoke", action(teams.revoke_key, "teams", admin=True))
    r.add_get("/console/usage", view(usage.usage, "usage"))
    r.add_get("/console/usage.csv", view(usage.usage_csv, "usage"))
    r.add_get("/console/batches", view(batches.batches, "batches"))
    r.add_post("/console/batches/{id}/cancel", action(batches.cancel_batch, "batches"))
    r.add_get("/console/requests", view(requests.requests, "requests"))
    r.add_get("/console/requests/{rid}", view(requests.trace, "requests"))
    r.add_get("/console/static/{name}", _static)


Lookup = Callable[[web.Request], tuple[GatewayState, Sessions, "Session | None"]]


def _home(s: Session) -> str:
    return "/console/cluster" if s.admin else "/console/usage"


def _index(session_of: Lookup) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def h(request: web.Request) -> web.Response:
        s = session_of(request)[2]
        return _redirect(_home(s) if s is not None else "/console/login")

    return h


def _secure(state: GatewayState, request: web.Request) -> bool:
    """Whether the browser reached us over HTTPS (cookies then travel only over HTTPS)."""
    return state.config.server.secure_cookies or state.auth.clients.https(request)


def _login_page(token: str, message: str = "", status: int = 200) -> web.Response:
    body = (
        message + '<form method="post" action="/console/login" class="card login">'
        f'<input type="hidden" name="csrf" value="{esc(token)}">'
        '<label for="key">API key (the admin key, or a team key)</label>'
        '<input id="key" name="key" type="password" required autocomplete="off" autofocus>'
        '<button type="submit">Sign in</button></form>'
    )
    return page("Sign in", "", body, None, status)


def _login_form(session_of: Lookup) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def h(request: web.Request) -> web.Response:
        s = session_of(request)[2]
        if s is not None:
            return _redirect(_home(s))
        token = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(32)
        msg = notice("Your session ended: sign in again.") if request.query.get("expired") else ""
        resp = _login_page(token, msg)
        set_cookie(resp, LOGIN_COOKIE, token, 3600, _secure(session_of(request)[0], request))
        return resp

    return h


def _login(session_of: Lookup) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def h(request: web.Request) -> web.Response:
        state, sessions, _ = session_of(request)
        form = await request.post()
        token = form.get("csrf")
        cookie = request.cookies.get(LOGIN_COOKIE)
        if cookie is None or not same(token if isinstance(token, str) else None, cookie):
            return _login_page(
                cookie or "",
                notice(
                    "Refused: the sign-in form's CSRF token is missing or wrong; reload the page.",
                    "error",
                ),
                403,
            )
        try:  # the admin API's limit on failed sign-ins per address
            state.auth.guard.check(state.auth.client(request))
        except APIError as e:
            return _login_page(cookie, notice(e.message, "error"), 429)
        key = str(form.get("key") or "").strip()
        probe = Session(sid="", key=key, team_id=None, csrf="", expires=time.time() + 10)
        try:  # the API says who the key is: the admin key reads every team, a team key its own
            who = await call(
                state, request, probe, "GET", "/v1/usage", query={"date": "1970-01-01"}
            )
        except ApiFailed as e:
            if e.status == 401:  # the API counted it against this browser's address
                return _login_page(
                    cookie, notice("That key is not valid (unknown or revoked).", "error"), 401
                )
            if e.status == 429:
                return _login_page(cookie, notice(e.message, "error"), 429)
            return _login_page(cookie, notice(f"Cannot sign in now: {e.message}", "error"), 503)
        s = sessions.new(key, who.get("team_id"))
        resp = _redirect(_home(s))
        set_cookie(resp, COOKIE, s.sid, TTL_S, _secure(state, request))
        resp.del_cookie(LOGIN_COOKIE, path="/console")
        return resp

    return h


def _logout(app: web.Application) -> Action:
    async def h(state: GatewayState, request: web.Request, s: Session, form: Any) -> web.Response:
        app[SESSIONS].drop(s.sid)
        resp = _redirect("/console/login")
        resp.del_cookie(COOKIE, path="/console")
        return resp

    return h


async def _static(request: web.Request) -> web.StreamResponse:
    p = _FILES.get(request.match_info["name"])
    if p is None:
        raise web.HTTPNotFound()
    return web.Response(
        body=p.read_bytes(),
        content_type=_TYPES[p.suffix],
        headers={"Cache-Control": "max-age=300", "X-Content-Type-Options": "nosniff"},
    )
