"""How often a team may call the batch API (files, batches, the simple form): at most
`[batch] max_api_calls_per_minute` calls per team per gateway, counted in the same sliding
window the gateway keeps for a team's requests per minute (accounts/team_gate.py `TeamGate`);
one more is a 429 `rate_limit_exceeded` with Retry-After (when the oldest call leaves the
window). Every batch call costs a store read or more — a listing, a status with its results
page, an upload — so a team polling in a tight loop waits instead of taking the store's time
from every other team's runs. 0 turns it off.

Invariant: the window counts this gateway's calls only (like the team gate's), each call once,
after its key was checked (an unknown key is the auth guard's to slow, not counted here).
"""

from __future__ import annotations

import inspect

from aiohttp import web

from gateway.accounts.store.base import Team
from gateway.accounts.team_gate import TeamGate, TeamLimited
from gateway.batch.contracts import Authenticate
from protocol.openai import APIError


def rate_limited(authenticate: Authenticate, calls_per_minute: int) -> Authenticate:
    """`authenticate`, then the team's call counted: a team past its calls gets the 429."""
    if calls_per_minute <= 0:
        return authenticate
    gate = TeamGate()

    async def check(request: web.Request) -> str:
        found = authenticate(request)
        team = await found if inspect.isawaitable(found) else found
        if not isinstance(team, str) or not team:
            return team  # the route's own check answers 401
        window = Team(id=team, rpm=calls_per_minute)
        try:
            gate.check(window, 0)
        except TeamLimited as e:
            raise APIError(
                429,
                f"team {team!r} made {calls_per_minute} batch API calls in the last minute "
                "([batch] max_api_calls_per_minute); retry later",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
                retry_after_s=e.retry_after_s,
            ) from None
        gate.started(window)
        return team

    return check
