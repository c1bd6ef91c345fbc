"""The console's batches page: a team's batches (every team's for the admin), and cancelling
one."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.console.api import call
from gateway.console.render import ago, csrf_field, esc, notice, page, table
from gateway.console.session import Session
from gateway.state import GatewayState

CANCELLABLE = ("validating", "in_progress", "finalizing")


def _batch_row(s: Session, b: dict[str, Any], team: str | None) -> list[Any]:
    c = b.get("request_counts") or {}
    total, done, failed = c.get("total", 0), c.get("completed", 0), c.get("failed", 0)
    errors = b.get("errors") or {}
    err = (
        "; ".join(str(e.get("message")) for e in (errors.get("data") or [])[:3])
        if isinstance(errors, dict)
        else ""
    )
    bar = (
        f'<progress max="{max(total, 1)}" value="{done + failed}" '
        f'aria-label="progress of {esc(b["id"])}">'
        f"</progress> {done + failed}/{total} ({failed} failed)"
    )
    action = ""
    if b["status"] in CANCELLABLE:
        label = f"Cancel batch {b['id']}" + (f" of team {team}" if team else "")
        action = (
            f'<form method="post" action="/console/batches/{esc(b["id"])}/cancel" class="inline">'
            f'{csrf_field(s)}<button type="submit" aria-label="{esc(label)}">Cancel</button></form>'
        )
    cells = [
        esc(b["id"]),
        esc(b["status"]),
        esc(ago(b.get("created_at"))),
        bar,
        esc(err or "-"),
        action,
    ]
    return [cells[0], esc(team), *cells[1:]] if team is not None else cells


async def batches(
    state: GatewayState, request: web.Request, s: Session, shown: str = ""
) -> web.Response:
    head = ["Batch", "Status", "Created", "Progress", "Errors", "Action"]
    if s.admin:  # every team's batches (GET /admin/batches), or one team's
        team = (request.query.get("team") or "").strip()
        listed = await call(
            state,
            request,
            s,
            "GET",
            "/admin/batches",
            query={"limit": "100", **({"team_id": team} if team else {})},
        )
        rows = [_batch_row(s, x["batch"], x["team_id"]) for x in listed["data"]]
        form = (
            '<form method="get" action="/console/batches" class="range">'
            f'<label>Team <input name="team" value="{esc(team)}" placeholder="all teams" '
            'autocomplete="off"></label><button type="submit">Show</button></form>'
        )
        more = '<p class="muted">Showing the newest 100.</p>' if listed.get("has_more") else ""
        return page(
            "Batches",
            "batches",
            shown
            + form
            + table(
                "Batches of every team" if not team else f"Batches of team {team}",
                [head[0], "Team", *head[1:]],
                rows,
                raw=True,
            )
            + more,
            s,
        )
    data = (await call(state, request, s, "GET", "/v1/batches", query={"limit": "100"}))["data"]
    rows = [_batch_row(s, b, None) for b in data]
    return page("Batches", "batches", shown + table("Batches", head, rows, raw=True), s)


async def cancel_batch(
    state: GatewayState, request: web.Request, s: Session, form: Any
) -> web.Response:
    bid = request.match_info["id"]
    # the admin cancels any team's batch; a team key its own (another team's answers 404)
    path = f"/admin/batches/{bid}/cancel" if s.admin else f"/v1/batches/{bid}/cancel"
    b = await call(state, request, s, "POST", path)
    b = b["batch"] if s.admin else b
    return await batches(state, request, s, notice(f"Batch {bid}: {b['status']}."))
