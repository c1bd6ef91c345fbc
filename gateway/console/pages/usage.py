"""The console's usage page (charts per day, team, model and tier) and its CSV export, read
through `GET /v1/usage` with the session's key."""

from __future__ import annotations

import asyncio
import csv
import io
import time
from typing import Any

from aiohttp import web

from gateway.console import charts
from gateway.console.api import ApiFailed, call
from gateway.console.render import esc, page, table
from gateway.console.session import Session
from gateway.state import GatewayState

DAY = 86400
#: group_by values the CSV export offers (those of `duet usage report`)
CSV_GROUPS = ("record", "day", "model", "team", "tier", "user", "adapter", "version")
#: records the CSV export reads from the API at a time (what it holds at most)
CSV_PAGE = 2000


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
    and TTFT percentiles the store computed (gateway/accounts/store/usage_totals.py), the rows
    `duet usage report --group-by …` prints — so the page's work is bounded by the number of
    groups, never by the records of the range."""
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
        '<form method="get" action="/console/usage" class="range">'
        f'<label>From <input type="date" name="start" value="{esc(start)}"></label>'
        f'<label>To <input type="date" name="end" value="{esc(end)}"></label>{team_sel}'
        '<button type="submit">Show</button></form>'
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
