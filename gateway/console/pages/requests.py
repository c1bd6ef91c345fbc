"""The console's requests page (the slow and failed requests of the last day) and a request's
trace: the gateway's own spans of it with those of the nodes that served it, asked for as the
page opens (node_spans.py)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from gateway.console import charts, node_spans
from gateway.console.api import call
from gateway.console.render import esc, notice, page, table
from gateway.console.session import Session
from gateway.state import GatewayState

DAY = 86400
#: slow or failed requests the Requests page lists at most
REQUESTS_SHOWN = 100


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
            "Tracing is off on this gateway: start it with --trace (or [tracing] enabled) to open "
            "a request's trace."
        )
        if ring is None
        else ""
    )
    intro = (
        "<p>The last 24 hours' failed requests and the slowest tenth. A request id links to its "
        "trace while the gateway still holds its spans.</p>"
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
                    f"The spans of node {f.node_id} ({f.url}) are unavailable: {f.detail}. The "
                    "timeline shows the rest.",
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
        f"<p>Trace <code>{esc(root.trace_id)}</code> of request <code>{esc(rid)}</code>: this "
        "gateway's spans"
        + (f", and those the nodes that served it hold ({esc(asked)})" if asked else "")
        + ". The coordinator's spans of the same trace go to your OTLP collector.</p>"
        + "".join(notes)
        + charts.timeline(f"Timeline of {rid}", bars)
        + table("Spans", ["Span", "Process", "Duration", "Attributes"], rows, raw=True)
    )
    return page("Trace", "requests", body, s)
