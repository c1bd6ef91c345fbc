"""The console's HTML: one layout, escaped cells, and the security headers every page carries.

Everything that came from outside (team ids, key names, node ids, span attributes) goes through
`esc`; pages are built on the server, so the strict CSP (scripts and styles from this origin's
/console/static only, nothing inline, no framing) costs nothing.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable, Sequence

from aiohttp import web

from gateway.console.session import Session

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src "
    "'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
NAV = (
    ("cluster", "Cluster", True),
    ("teams", "Teams and keys", False),
    ("usage", "Usage and spend", False),
    ("batches", "Batches", False),
    ("requests", "Requests", False),
)


def esc(x: object) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def csrf_field(session: Session) -> str:
    return f'<input type="hidden" name="csrf" value="{esc(session.csrf)}">'


def table(
    caption: str,
    head: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    raw: bool = False,
    body_id: str | None = None,
) -> str:
    """`rows` are escaped unless `raw` (cells the caller built from escaped parts)."""
    cell = (lambda x: str(x)) if raw else esc
    body = "".join("<tr>" + "".join(f"<td>{cell(c)}</td>" for c in r) + "</tr>" for r in rows)
    if not body:
        body = f'<tr><td colspan="{len(head)}">none</td></tr>'
    ths = "".join(f'<th scope="col">{esc(h)}</th>' for h in head)
    bid = f' id="{esc(body_id)}"' if body_id else ""
    return (
        f"<table><caption>{esc(caption)}</caption><thead><tr>{ths}</tr></thead>"
        f"<tbody{bid}>{body}</tbody></table>"
    )


def notice(text: str, kind: str = "info") -> str:
    role = "alert" if kind == "error" else "status"
    return f'<p class="notice {kind}" role="{role}">{esc(text)}</p>'


def page(
    title: str, active: str, body: str, session: Session | None, status: int = 200
) -> web.Response:
    nav, who = "", ""
    if session is not None:
        items = "".join(
            f'<li><a href="/console/{k}"{" aria-current=page" if k == active else ""}>'
            f"{esc(label)}</a></li>"
            for k, label, admin_only in NAV
            if session.admin or not admin_only
        )
        nav = f'<nav aria-label="Console pages"><ul>{items}</ul></nav>'
        who = "admin" if session.admin else f"team {session.team_id}"
        who = (
            f'<form class="signout" method="post" action="/console/logout">{csrf_field(session)}'
            f"<span>Signed in as <strong>{esc(who)}</strong></span> "
            '<button type="submit">Sign out</button></form>'
        )
    meta = f'<meta name="csrf-token" content="{esc(session.csrf)}">' if session is not None else ""
    doc = (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">{meta}'
        f"<title>{esc(title)} · duet console</title>"
        f'<link rel="stylesheet" href="/console/static/console.css">'
        f'<script src="/console/static/console.js" defer></script></head><body>'
        f'<a class="skip" href="#main">Skip to content</a>'
        f'<header><span class="brand">duet</span>{nav}{who}</header>'
        f'<main id="main" tabindex="-1"><h1>{esc(title)}</h1>{body}</main></body></html>'
    )
    return web.Response(status=status, text=doc, content_type="text/html", headers=HEADERS)


def fragment(body: str) -> web.Response:
    """A part of a page (the cluster tables' live refresh)."""
    return web.Response(text=body, content_type="text/html", headers=HEADERS)


def ago(t: float | None) -> str:
    """How long ago unix time `t` was, in words ("-" for never)."""
    if not t:
        return "-"
    s = max(0, time.time() - t)
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.0f} min" if s < 7200 else f"{s / 3600:.1f} h"
