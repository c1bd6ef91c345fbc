"""The console's teams and keys page, and its forms (admin only): create a team, set its
limits, create and revoke keys, each through the gateway's admin API."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.console.api import ApiFailed, call
from gateway.console.render import ago, csrf_field, esc, notice, page, table
from gateway.console.session import Session
from gateway.state import GatewayState

LIMITS = (
    ("rpm", "Requests per minute"),
    ("tpm", "Tokens per minute"),
    ("max_concurrent", "Concurrent requests"),
    ("daily_budget_usd", "Daily budget (USD)"),
    ("monthly_budget_usd", "Monthly budget (USD)"),
)


def _limit_fields(keep: bool = False) -> str:
    """The limit inputs; `keep`: the set-limits form, whose empty fields keep the team's values
    (its tier select offers 'unchanged' first)."""
    unchanged = '<option value="">unchanged</option>' if keep else ""
    mode = "" if keep else ' inputmode="decimal"'  # `none` must be typable on a phone's keyboard
    return (
        "".join(
            f'<label>{esc(label)} <input name="{k}"{mode} autocomplete="off"></label>'
            for k, label in LIMITS
        )
        + f'<label>Default tier <select name="default_tier">{unchanged}<option>interactive</option>'
        "<option>batch</option></select></label>"
    )


def _team_forms(s: Session, options: str) -> str:
    create = (
        '<form method="post" action="/console/teams" class="card"><h2>Create a team</h2>'
        f'{csrf_field(s)}<label>Team id <input name="id" required '
        f'pattern="[A-Za-z0-9][A-Za-z0-9_.\\-]{{0,63}}" autocomplete="off"></label>'
        f'{_limit_fields()}<button type="submit">Create team</button></form>'
    )
    limits = (
        '<form method="post" action="/console/teams/limits" class="card">'
        "<h2>Set a team's limits</h2>"
        f'{csrf_field(s)}<label>Team <select name="id" required>{options}</select></label>'
        f'<p class="muted">A field left empty keeps its limit; <code>none</code> removes it.</p>'
        f"{_limit_fields(keep=True)}"
        f'<button type="submit">Set limits</button></form>'
    )
    return create + limits


async def teams(
    state: GatewayState, request: web.Request, s: Session, shown: str = ""
) -> web.Response:
    if not s.admin:
        return page(
            "Teams and keys",
            "teams",
            notice(
                f"You are signed in with a key of team {s.team_id}. Teams and "
                "keys are managed with the admin key."
            )
            + shown,
            s,
        )
    team_list = (await call(state, request, s, "GET", "/admin/teams"))["data"]
    keys = (await call(state, request, s, "GET", "/admin/keys"))["data"]
    t_rows = [
        [
            esc(t["id"]),
            *(esc("-" if t.get(k) is None else t[k]) for k, _ in LIMITS),
            esc(t["default_tier"]),
        ]
        for t in team_list
    ]
    k_rows = []
    for k in keys:
        revoked = k.get("revoked_at")
        action = (
            "revoked"
            if revoked
            else (
                f'<form method="post" action="/console/keys/{esc(k["id"])}/revoke" '
                f'class="inline">{csrf_field(s)}<button type="submit" '
                f'aria-label="Revoke key {esc(k["id"])}">Revoke</button></form>'
            )
        )
        k_rows.append(
            [
                esc(k["id"]),
                esc(k["team_id"]),
                esc(k.get("name") or ""),
                esc(ago(k.get("created_at"))),
                action,
            ]
        )
    options = "".join(f"<option>{esc(t['id'])}</option>" for t in team_list)
    key_form = (
        '<form method="post" action="/console/keys" class="card"><h2>Create a key</h2>'
        f'{csrf_field(s)}<label>Team <select name="team_id" required>{options}</select></label>'
        '<label>Name <input name="name" autocomplete="off"></label>'
        '<button type="submit">Create key</button></form>'
    )
    body = (
        shown
        + table(
            "Teams", ["Team", *(label for _, label in LIMITS), "Default tier"], t_rows, raw=True
        )
        + table("Keys", ["Key id", "Team", "Name", "Created", "Action"], k_rows, raw=True)
        + '<div class="forms">'
        + _team_forms(s, options)
        + key_form
        + "</div>"
    )
    return page("Teams and keys", "teams", body, s)


def _number(form: Any, name: str) -> float | int | None:
    raw = (form.get(name) or "").strip()
    if not raw:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise ApiFailed(400, f"{name} must be a number, got {raw!r}") from None
    return int(v) if v.is_integer() and name in ("rpm", "tpm", "max_concurrent") else v


async def create_team(
    state: GatewayState, request: web.Request, s: Session, form: Any
) -> web.Response:
    body: dict[str, Any] = {
        "id": (form.get("id") or "").strip(),
        "default_tier": form.get("default_tier") or "interactive",
    }
    for k, _ in LIMITS:
        v = _number(form, k)
        if v is not None:
            body[k] = v
    t = await call(state, request, s, "POST", "/admin/teams", body=body)
    return await teams(state, request, s, notice(f"Team {t['id']} created."))


async def set_limits(
    state: GatewayState, request: web.Request, s: Session, form: Any
) -> web.Response:
    """PUT sets every limit, so the form starts from the team's current ones: a field left
    empty keeps its limit, `none` removes it (an empty field that cleared a budget would take a
    team's spending cap off while its admin changed only the request rate)."""
    tid = (form.get("id") or "").strip()
    current = await call(state, request, s, "GET", f"/admin/teams/{tid}")
    body: dict[str, Any] = {"default_tier": form.get("default_tier") or current["default_tier"]}
    for k, _ in LIMITS:
        raw = (form.get(k) or "").strip()
        body[k] = current.get(k) if not raw else None if raw.lower() == "none" else _number(form, k)
    t = await call(state, request, s, "PUT", f"/admin/teams/{tid}", body=body)
    return await teams(state, request, s, notice(f"Limits of team {t['id']} set."))


async def create_key(
    state: GatewayState, request: web.Request, s: Session, form: Any
) -> web.Response:
    k = await call(
        state,
        request,
        s,
        "POST",
        "/admin/keys",
        body={"team_id": form.get("team_id") or "", "name": form.get("name") or ""},
    )
    shown = (
        f'<div class="card secret" role="status"><h2>New key for team {esc(k["team_id"])}</h2>'
        f"<p>Copy it now: it is shown this once and never again.</p>"
        f'<label>Key <input id="new-key" readonly value="{esc(k["key"])}" size="60"></label>'
        f'<p>Key id <code id="new-key-id">{esc(k["id"])}</code></p></div>'
    )
    return await teams(state, request, s, shown)


async def revoke_key(
    state: GatewayState, request: web.Request, s: Session, form: Any
) -> web.Response:
    kid = request.match_info["id"]
    await call(state, request, s, "DELETE", f"/admin/keys/{kid}")
    return await teams(state, request, s, notice(f"Key {kid} revoked."))
