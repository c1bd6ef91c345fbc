"""The console's pages, each a handler of (state, request, session).

Every read and change goes through the gateway's own API with the session's key
(gateway/console/api.py), so a team key sees exactly what the API shows it — its own team —
and the admin key everything. The cluster page reads the coordinator replicas' `GET /cluster`
and the gateway's etcd view, like `duet status`, and the leader's `GET /planner`
(gateway/console/autoscaler.py). A request's trace page is the gateway's own spans of it with
those of the nodes that served it, asked for as the page opens (gateway/console/node_spans.py).
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import os
import time
from collections import Counter
from typing import Any

import aiohttp
from aiohttp import web

from gateway.console import autoscaler, charts, node_spans
from gateway.console.api import ApiFailed, call
from gateway.console.render import csrf_field, esc, fragment, notice, page, table
from gateway.console.session import Session
from gateway.state import GatewayState
from runtime.models import duet_home

DAY = 86400
#: group_by values the CSV export offers (those of `duet usage report`)
CSV_GROUPS = ("record", "day", "model", "team", "tier", "user")
_TIMEOUT = aiohttp.ClientTimeout(total=3)
#: slow or failed requests the Requests page lists at most
REQUESTS_SHOWN = 100
#: records the CSV export reads from the API at a time (what it holds at most)
CSV_PAGE = 2000


# --- cluster ----------------------------------------------------------------------------------
async def _replica(state: GatewayState, url: str) -> dict[str, Any] | str:
    try:
        # the coordinator's internal API: the cluster secret, as the route client sends it
        async with state.session.get(
            url + "/cluster", timeout=_TIMEOUT, headers=state.config.security.headers
        ) as r:
            if r.status != 200:
                return f"HTTP {r.status}"
            return await r.json()
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def _ago(t: float | None) -> str:
    if not t:
        return "-"
    s = max(0, time.time() - t)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _supervised() -> list[dict[str, Any]]:
    """The processes a running `duet up` on this machine supervises (its state file), if any.
    A state file whose `duet up` is dead (SIGKILLed: it could not remove it) is ignored, as
    `duet status` ignores it: its processes are gone, not "running"."""
    try:
        data = json.loads((duet_home() / "up" / "state.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or not _alive(data.get("pid")):
        return []
    children = data.get("children")
    return [c for c in children if isinstance(c, dict)] if isinstance(children, list) else []


async def cluster_tables(state: GatewayState) -> str:
    urls = state.topology.coordinator_urls()
    reports = await asyncio.gather(*(_replica(state, u) for u in urls))
    infos = {i.node_id: i for i in state.topology.nodes}
    first = next((r for r in reports if isinstance(r, dict)), None)
    sup = _supervised()
    # a node's restarts are its process's under `duet up` (whose process name is the node id);
    # elsewhere (Kubernetes, systemd) its orchestrator counts them: "-"
    restarts = {c.get("name"): c.get("restarts", 0) for c in sup}
    rows = []
    if first is not None:
        for n in first.get("nodes", []):
            info = infos.get(n["node_id"])
            load = n.get("load") or {}
            health = (
                "ready"
                if n.get("ready")
                else ("connected" if n.get("connected") else "unreachable")
            )
            rows.append(
                [
                    n["node_id"],
                    n["role"],
                    n.get("pool", ""),
                    info.engine_kind if info else "-",
                    (info.quantization or "none") if info else "-",
                    f"{n['status']}, {health}",
                    restarts.get(n["node_id"], "-"),
                    f"{load.get('running', '-')} running, {load.get('waiting', '-')} waiting",
                    f"{100 * load['kv_cache_usage_perc']:.1f}%"
                    if "kv_cache_usage_perc" in load
                    else "-",
                    n.get("indexed_blocks", 0),
                    _ago(info.started_at) if info else "-",
                    n.get("resyncs", 0),
                ]
            )
    else:
        for i in infos.values():
            rows.append(
                [
                    i.node_id,
                    i.role,
                    i.pool,
                    i.engine_kind,
                    i.quantization or "none",
                    f"{i.status} (etcd only)",
                    restarts.get(i.node_id, "-"),
                    "-",
                    "-",
                    "-",
                    _ago(i.started_at),
                    "-",
                ]
            )
    # What a screen reader hears when it changes (the page's status region, console.js): the
    # node count and each health's share, not the tables, which are replaced every 3 s.
    healths = Counter(str(r[5]) for r in rows)
    summary = f"{len(rows)} node{'s' * (len(rows) != 1)}" + (
        ": " + ", ".join(f"{n} {h}" for h, n in sorted(healths.items())) if healths else ""
    )
    out = [
        f'<p class="summary" data-summary="{esc(summary)}">{esc(summary)}</p>',
        table(
            "Nodes",
            [
                "Node",
                "Role",
                "Pool",
                "Engine",
                "Quantization",
                "Health",
                "Restarts",
                "Load",
                "KV use",
                "Cached blocks",
                "Up for",
                "Resyncs",
            ],
            rows,
        ),
    ]
    reps = []
    for url, r in zip(urls, reports, strict=True):
        if isinstance(r, dict):
            reps.append(
                [
                    url,
                    r["replica_id"],
                    "yes" if r["is_leader"] else "no",
                    r.get("leader") or "unknown",
                    "connected" if r["etcd_connected"] else "disconnected",
                    f"{r['index_blocks']} / {r['index_max_blocks']}",
                ]
            )
        else:
            reps.append([url, "-", "-", "-", "-", f"unreachable: {r}"])
    out.append(
        table(
            "Coordinator replicas",
            ["URL", "Replica", "Leader", "Leader seen", "etcd", "Prefix index"],
            reps,
        )
    )
    out.append(await autoscaler.section(state, urls, reports))
    etcd = state.topology.etcd
    if etcd is not None:
        state_text = f"read {_ago(etcd.read_at)} ago" + (
            f"; last read failed: {etcd.error}" if etcd.error else ""
        )
        out.append(
            table(
                "etcd",
                ["Endpoint", "State", "Registered nodes", "Replicas"],
                [[etcd.endpoint, state_text, len(etcd.infos), len(etcd.coordinators)]],
            )
        )
    if sup:
        out.append(
            table(
                "Processes supervised by duet up",
                ["Process", "State", "PID", "Restarts"],
                [
                    [
                        c.get("name"),
                        c.get("state") or ("running" if c.get("alive") else "down"),
                        c.get("pid"),
                        c.get("restarts", 0),
                    ]
                    for c in sup
                ],
            )
        )
    out.append(
        f'<p class="muted">Updated {time.strftime("%H:%M:%S", time.gmtime())} UTC; refreshes every 3 s.</p>'
    )
    return "".join(out)


async def cluster(state: GatewayState, request: web.Request, s: Session) -> web.Response:
    body = await cluster_tables(state)
    if request.query.get("fragment"):
        return fragment(body)
    # The tables are not a live region (re-announced whole every 3 s); the status line says what
    # changed in the node summary.
    return page(
        "Cluster",
        "cluster",
        '<p id="live-status" class="visually-hidden" role="status" aria-live="polite">'
        f'</p><div id="live" data-refresh="/console/cluster?fragment=1">{body}</div>',
        s,
    )


# --- teams and keys ---------------------------------------------------------------------------
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
        f'<form method="post" action="/console/teams" class="card"><h2>Create a team</h2>{csrf_field(s)}'
        f'<label>Team id <input name="id" required pattern="[A-Za-z0-9][A-Za-z0-9_.\\-]{{0,63}}" '
        f'autocomplete="off"></label>{_limit_fields()}<button type="submit">Create team</button></form>'
    )
    limits = (
        f'<form method="post" action="/console/teams/limits" class="card"><h2>Set a team\'s limits</h2>'
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
                f'<form method="post" action="/console/keys/{esc(k["id"])}/revoke" class="inline">{csrf_field(s)}'
                f'<button type="submit" aria-label="Revoke key {esc(k["id"])}">Revoke</button></form>'
            )
        )
        k_rows.append(
            [
                esc(k["id"]),
                esc(k["team_id"]),
                esc(k.get("name") or ""),
                esc(_ago(k.get("created_at"))),
                action,
            ]
        )
    options = "".join(f"<option>{esc(t['id'])}</option>" for t in team_list)
    key_form = (
        f'<form method="post" action="/console/keys" class="card"><h2>Create a key</h2>{csrf_field(s)}'
        f'<label>Team <select name="team_id" required>{options}</select></label>'
        f'<label>Name <input name="name" autocomplete="off"></label>'
        f'<button type="submit">Create key</button></form>'
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


# --- usage and spend --------------------------------------------------------------------------
def _range(request: web.Request) -> tuple[str, str]:
    """YYYY-MM-DD start and (inclusive) end; the last 7 days by default."""
    today = time.strftime("%Y-%m-%d", time.gmtime())
    week = time.strftime("%Y-%m-%d", time.gmtime(time.time() - 6 * DAY))
    start, end = request.query.get("start") or week, request.query.get("end") or today
    for v in (start, end):
        try:
            time.strptime(v, "%Y-%m-%d")
        except ValueError:
            raise ApiFailed(400, "start and end are dates: YYYY-MM-DD") from None
    return start, end


def _query(s: Session, request: web.Request, start: str, end: str, group_by: str) -> dict[str, str]:
    q = {"start": start, "end": end, "group_by": group_by}
    team = request.query.get("team")
    if s.admin and team:
        q["team_id"] = team
    return q


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


async def usage(state: GatewayState, request: web.Request, s: Session) -> web.Response:
    """Every figure is a row of `GET /v1/usage` grouped by day, team, model or tier — totals
    and TTFT percentiles the store computed (gateway/store/usage_totals.py), the rows `duet usage
    report --group-by …` prints — so the page's work is bounded by the number of groups, never
    by the records of the range."""
    start, end = _range(request)

    def get(g: str):
        return call(state, request, s, "GET", "/v1/usage", query=_query(s, request, start, end, g))

    by_day, by_team, by_model, by_tier = await asyncio.gather(
        get("day"), get("team"), get("model"), get("tier")
    )
    days = [r["date"] for r in by_day["data"]]
    team_sel = ""
    if s.admin:
        team_sel = (
            f'<label>Team <input name="team" value="{esc(request.query.get("team") or "")}" '
            f'placeholder="all teams" autocomplete="off"></label>'
        )
    form = (
        f'<form method="get" action="/console/usage" class="range"><label>From <input type="date" name="start" '
        f'value="{esc(start)}"></label><label>To <input type="date" name="end" value="{esc(end)}"></label>{team_sel}'
        f'<button type="submit">Show</button></form>'
    )
    qs = "&".join(
        f"{k}={esc(v)}" for k, v in _query(s, request, start, end, "").items() if k != "group_by"
    )
    csv_links = " ".join(
        f'<a href="/console/usage.csv?{qs}&amp;group_by={g}" download>{g}</a>' for g in CSV_GROUPS
    )
    charts_html = (
        charts.bars("Tokens per day", days, [r["total_tokens"] for r in by_day["data"]])
        + charts.bars("Spend per day (USD)", days, [r["cost_usd"] for r in by_day["data"]], " USD")
        + charts.bars("Requests per day", days, [r["requests"] for r in by_day["data"]])
        + charts.lines(
            "Time to first token (ms)",
            days,
            {
                "P50": [_ms(r["ttft_p50_s"]) for r in by_day["data"]],
                "P90": [_ms(r["ttft_p90_s"]) for r in by_day["data"]],
            },
            " ms",
        )
    )

    def rows(data: list[dict[str, Any]], key: str) -> list[list[Any]]:
        return [
            [
                r[key] if r[key] is not None else "-",
                r["requests"],
                r["prompt_tokens"],
                r["completion_tokens"],
                r["cached_tokens"],
                f"{r['cost_usd']:.6f}",
                ms_cell(r["ttft_p50_s"]),
                ms_cell(r["ttft_p90_s"]),
            ]
            for r in data
        ]

    head = [
        "Requests",
        "Prompt tokens",
        "Completion tokens",
        "Cached tokens",
        "Cost (USD)",
        "TTFT P50 (ms)",
        "TTFT P90 (ms)",
    ]
    body = (
        form
        + f'<p class="csv">CSV export (as <code>duet usage report</code>): {csv_links}</p>'
        + f'<div class="charts">{charts_html}</div>'
        + table("Per day", ["Day", *head], rows(by_day["data"], "date"))
        + table("Per team", ["Team", *head], rows(by_team["data"], "team_id"))
        + table("Per model", ["Model", *head], rows(by_model["data"], "model"))
        + table("Per tier", ["Tier", *head], rows(by_tier["data"], "tier"))
    )
    return page("Usage and spend", "usage", body, s)


def ms_cell(seconds: float | None) -> str:
    """A TTFT percentile (seconds, as the report gives it) as the tables show it."""
    return "-" if seconds is None else f"{seconds * 1000:.3f}"


def usage_csv_text(rows: list[dict[str, Any]]) -> str:
    """The rows as `duet usage report --format csv` prints them (csv.DictWriter, header first)."""
    out = io.StringIO()
    if rows:
        w = csv.DictWriter(out, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return out.getvalue()


async def usage_csv(state: GatewayState, request: web.Request, s: Session) -> web.StreamResponse:
    start, end = _range(request)
    group_by = request.query.get("group_by", "record")
    if group_by not in CSV_GROUPS:
        raise ApiFailed(400, f"group_by is one of {', '.join(CSV_GROUPS)}")
    query = _query(s, request, start, end, group_by)
    headers = {
        "Content-Disposition": f'attachment; filename="usage-{start}-{end}-{group_by}.csv"',
        "Cache-Control": "no-store",
    }
    if group_by != "record":  # one row per group
        data = await call(state, request, s, "GET", "/v1/usage", query=query)
        return web.Response(
            text=usage_csv_text(data["data"]), content_type="text/csv", headers=headers
        )
    # every record of the range: read a page at a time and written as it comes, so the
    # gateway holds one page however long the range (the bytes are the report's all the same)
    page = await call(
        state, request, s, "GET", "/v1/usage", query={**query, "limit": str(CSV_PAGE)}
    )
    resp = web.StreamResponse(headers={**headers, "Content-Type": "text/csv; charset=utf-8"})
    await resp.prepare(request)
    fields: list[str] | None = None
    while True:
        rows = page["data"]
        if rows:
            out = io.StringIO()
            w = csv.DictWriter(out, fieldnames=fields or list(rows[0]))
            if fields is None:
                fields = list(rows[0])
                w.writeheader()
            w.writerows(rows)
            await resp.write(out.getvalue().encode())
        if not page.get("next"):
            break
        try:
            page = await call(
                state,
                request,
                s,
                "GET",
                "/v1/usage",
                query={**query, "limit": str(CSV_PAGE), "after": page["next"]},
            )
        except (
            ApiFailed
        ):  # the status is sent already: cut the download short (the client sees it fail)
            resp.force_close()
            if request.transport is not None:
                request.transport.close()
            return resp
    await resp.write_eof()
    return resp


# --- batches ----------------------------------------------------------------------------------
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
        f'<progress max="{max(total, 1)}" value="{done + failed}" aria-label="progress of {esc(b["id"])}">'
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
        esc(_ago(b.get("created_at"))),
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
            f'<form method="get" action="/console/batches" class="range"><label>Team <input name="team" '
            f'value="{esc(team)}" placeholder="all teams" autocomplete="off"></label>'
            f'<button type="submit">Show</button></form>'
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


# --- requests and traces ----------------------------------------------------------------------
async def requests(state: GatewayState, request: web.Request, s: Session) -> web.Response:
    # the store picks them (the failed and the slowest tenth, newest first, at most 100): a
    # day of records never leaves the database for this page
    since = time.strftime("%Y-%m-%d", time.gmtime(time.time() - DAY))
    picked = (
        await call(
            state,
            request,
            s,
            "GET",
            "/v1/usage",
            query={
                "start": since,
                "group_by": "record",
                "outliers": "true",
                "limit": str(REQUESTS_SHOWN),
            },
        )
    )["data"]
    ring = state.tracing.ring
    traced_ids = ring.values("duet.request_id") if ring is not None else set()
    rows = []
    for r in picked:
        rid = r["request_id"]
        traced = rid in traced_ids
        link = f'<a href="/console/requests/{esc(rid)}">{esc(rid)}</a>' if traced else esc(rid)
        why = "failed" if r["status"] != "ok" else "slow"
        rows.append(
            [
                esc(time.strftime("%H:%M:%S", time.gmtime(r["created_at"]))),
                link,
                esc(r["team_id"]),
                esc(r["model_used"]),
                esc(r["status"]),
                esc(why),
                esc("-" if r.get("ttft_s") is None else f"{r['ttft_s'] * 1000:.1f} ms"),
                esc(f"{r['latency_s'] * 1000:.1f} ms"),
                esc(r["completion_tokens"]),
            ]
        )
    recent = []
    for x in ring.requests(200) if ring is not None else []:
        if s.admin or x.attributes.get("duet.team") == s.team_id:
            a, rid = x.attributes, str(x.attributes["duet.request_id"])
            recent.append(
                [
                    esc(time.strftime("%H:%M:%S", time.gmtime(x.start_ns / 1e9))),
                    f'<a href="/console/requests/{esc(rid)}">{esc(rid)}</a>',
                    esc(a.get("duet.team")),
                    esc(a.get("gen_ai.request.model")),
                    esc(a.get("duet.status")),
                    esc(f"{(x.end_ns - x.start_ns) / 1e6:.1f} ms"),
                    esc(a.get("gen_ai.usage.output_tokens")),
                ]
            )
        if len(recent) >= 20:
            break
    head = (
        notice(
            "Tracing is off on this gateway: start it with --trace (or [tracing] enabled) to open a "
            "request's trace."
        )
        if ring is None
        else ""
    )
    intro = (
        "<p>The last 24 hours' failed requests and the slowest tenth. A request id links to its trace "
        "while the gateway still holds its spans.</p>"
    )
    return page(
        "Requests",
        "requests",
        head
        + intro
        + table(
            "Slow or failed requests",
            [
                "Time (UTC)",
                "Request",
                "Team",
                "Model",
                "Status",
                "Why",
                "TTFT",
                "Latency",
                "Tokens out",
            ],
            rows,
            raw=True,
        )
        + table(
            "Recent traced requests",
            ["Time (UTC)", "Request", "Team", "Model", "Status", "Latency", "Tokens out"],
            recent,
            raw=True,
        ),
        s,
    )


def _attr(v: object) -> str:
    """A span attribute as an operator reads it: a sequence's items joined (OTel keeps them as
    tuples, whose repr showed parentheses and quotes)."""
    if isinstance(v, (list, tuple)):
        return ", ".join(str(i) for i in v)
    return str(v)


async def trace(state: GatewayState, request: web.Request, s: Session) -> web.Response:
    rid = request.match_info["rid"]
    ring = state.tracing.ring
    root = ring.find("duet.request_id", rid) if ring is not None else None
    if root is None or (not s.admin and root.attributes.get("duet.team") != s.team_id):
        return page(
            "Trace",
            "requests",
            notice(
                f"No trace of {rid} is held here (tracing off, or its spans "
                "aged out of the gateway's ring).",
                "error",
            ),
            s,
            404,
        )
    own = ring.trace(root.trace_id) if ring is not None else []
    # the P and D legs' spans, from the nodes that served the request (node_spans.py)
    fetched = await node_spans.fetch(state, root.trace_id, own)
    process = {x.span_id: x.service for x in own}
    node_of: dict[str, str] = {}  # a node's span → its node id
    notes = []
    for f in fetched:
        for x in f.spans:
            if x.span_id not in process:
                process[x.span_id], node_of[x.span_id] = f"{f.node_id} ({x.service})", f.node_id
        if f.outcome is node_spans.Fetched.UNAVAILABLE:
            notes.append(
                notice(
                    f"The spans of node {f.node_id} ({f.url}) are unavailable: {f.detail}. The timeline "
                    "shows the rest.",
                    "error",
                )
            )
        elif f.outcome is node_spans.Fetched.NOT_KEPT:
            notes.append(notice(f"Node {f.node_id} keeps no spans (tracing is off on it)."))
        elif f.detail:
            notes.append(notice(f"Node {f.node_id}: {f.detail}."))
    ordered = node_spans.tree([*own, *(x for f in fetched for x in f.spans)])
    t0 = min(x.start_ns for x, _ in ordered)

    def label(x: Any) -> str:  # a node's span names its node: P's and D's server spans share a name
        return f"{x.name} · {node_of[x.span_id]}" if x.span_id in node_of else x.name

    bars = [
        (label(x), d, (x.start_ns - t0) / 1e6, (x.end_ns - t0) / 1e6, x.error) for x, d in ordered
    ]
    rows = [
        [
            f'<span class="depth" data-depth="{d}">{esc(x.name)}</span>',
            esc(process[x.span_id]),
            esc(f"{(x.end_ns - x.start_ns) / 1e6:.2f} ms"),
            "<dl>"
            + "".join(
                f"<dt>{esc(k)}</dt><dd>{esc(_attr(v))}</dd>"
                for k, v in sorted(x.attributes.items())
            )
            + "</dl>",
        ]
        for x, d in ordered
    ]
    asked = ", ".join(f.node_id for f in fetched)
    body = (
        f"<p>Trace <code>{esc(root.trace_id)}</code> of request <code>{esc(rid)}</code>: this gateway's spans"
        + (f", and those the nodes that served it hold ({esc(asked)})" if asked else "")
        + ". The coordinator's spans of the same trace go to your OTLP collector.</p>"
        + "".join(notes)
        + charts.timeline(f"Timeline of {rid}", bars)
        + table("Spans", ["Span", "Process", "Duration", "Attributes"], rows, raw=True)
    )
    return page("Trace", "requests", body, s)
