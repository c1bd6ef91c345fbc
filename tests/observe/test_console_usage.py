"""The console's Usage and spend page and its CSV export on a synthetic usage table (a real
gateway app on a real socket, its SQLite store filled with 3000 records over three days):

- the page's work is bounded by the number of groups: it never asks the store for a record
  (`usage_records` is not called) and the store hands it one row per day, team, model and tier
  — the old page read every record of the range to add up tiers and TTFT percentiles;
- every figure it shows (the tables' cells, the TTFT chart) and the CSV of each grouping are
  exactly `duet usage report`'s, run as a process on the same database file.

The Requests page on 3000 records of the last 20 hours: the store picks the failed requests and
the slowest tenth (`GET /v1/usage?group_by=record&outliers=true&limit=100`); the page gets 100
records, no more, and lists exactly the reference's, newest first.

No browser: the page's HTML is read as served (tests/observe/test_console.py drives Chromium).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.store.base import Settlement, UsageRecord
from gateway.app import STATE, make_app
from gateway.config import parse_config
from gateway.console import charts
from gateway.console.pages import usage as pages
from gateway.console.pages.usage import ms_cell
from tests.gateway.helpers import ADMIN_KEY
from tests.gateway.test_usage_totals import DAY0, outliers, synthetic

#: DAY0 and the two days after it: every synthetic record
START, END = (time.strftime("%Y-%m-%d", time.gmtime(DAY0 + d * 86400)) for d in (0, 2))


class Tables(HTMLParser):
    """Each table's caption → its body rows' cell texts; each svg's aria-label → its desc."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self.descs: dict[str, str] = {}
        self._caption: str | None = None
        self._in: str | None = None
        self._svg = ""
        self._text = ""
        self._row: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("caption", "td", "desc"):
            self._in, self._text = tag, ""
        elif tag == "tr":
            self._row = []
        elif tag == "svg":
            self._svg = dict(attrs).get("aria-label") or ""

    def handle_endtag(self, tag: str) -> None:
        if tag == "caption":
            self._caption = self._text
            self.tables[self._caption] = []
        elif tag == "td" and self._row is not None:
            self._row.append(self._text)
        elif tag == "tr" and self._row and self._caption is not None:
            self.tables[self._caption].append(self._row)
        elif tag == "desc":
            self.descs[self._svg] = self._text
        if tag in ("caption", "td", "desc"):
            self._in = None

    def handle_data(self, data: str) -> None:
        if self._in:
            self._text += data


def report(db: Path, group_by: str, fmt: str = "json") -> Any:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "duet",
            "usage",
            "report",
            "--store",
            f"sqlite://{db}",
            "--start",
            START,
            "--end",
            END,
            "--group-by",
            group_by,
            "--format",
            fmt,
        ],
        capture_output=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout) if fmt == "json" else out.stdout.decode()


def cells(rows: list[dict[str, Any]], key: str) -> list[list[str]]:
    """Report rows as the page's tables show them."""
    return [
        [
            str(r[key]) if r[key] is not None else "-",
            str(r["requests"]),
            str(r["prompt_tokens"]),
            str(r["completion_tokens"]),
            str(r["cached_tokens"]),
            f"{r['cost_usd']:.6f}",
            ms_cell(r["ttft_p50_s"]),
            ms_cell(r["ttft_p90_s"]),
        ]
        for r in rows
    ]


def desc(svg: str) -> str:
    """A chart's text description, as the browser reads it."""
    p = Tables()
    p.feed(svg)
    return p.descs[""]


async def sign_in(client: TestClient) -> None:
    form = await (await client.get("/console/login")).text()
    token = re.search(r'name="csrf" value="([^"]+)"', form)
    assert token, form
    r = await client.post(
        "/console/login", data={"csrf": token.group(1), "key": ADMIN_KEY}, allow_redirects=False
    )
    assert r.status == 303, await r.text()


def console_app(tiny_llama: Path, db: Path) -> web.Application:
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{db}"},
            "server": {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    return make_app(cfg)


async def fill(store: Any, records: list[UsageRecord]) -> None:
    for i in range(0, len(records), 500):
        await store.settle([Settlement(None, r) for r in records[i : i + 500]])


async def test_usage_page_reads_groups_not_records_and_equals_the_report(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pages, "CSV_PAGE", 700)  # the record export in five pages
    db = tmp_path / "g.db"
    app = console_app(tiny_llama, db)
    async with TestClient(TestServer(app)) as client:
        store = app[STATE].store
        await fill(store, synthetic(3000))
        await sign_in(client)
        # the store as the page sees it: every record or group row it hands out is counted
        fetched = {"records": 0, "rows": 0}
        record_pages: list[int] = []  # records each usage_records call handed out
        usage, usage_records = store.usage, store.usage_records

        async def counted_usage(*a: Any) -> list[dict[str, Any]]:
            rows = await usage(*a)
            fetched["rows"] += len(rows)
            return rows

        async def counted_records(*a: Any) -> Any:
            recs = await usage_records(*a)
            fetched["records"] += len(recs)
            record_pages.append(len(recs))
            return recs

        store.usage, store.usage_records = counted_usage, counted_records  # type: ignore[method-assign]
        r = await client.get(f"/console/usage?start={START}&end={END}")
        html = await r.text()
        assert r.status == 200, html
        # three days + three teams + three models + two tiers: one row each, no record
        assert fetched == {"records": 0, "rows": 3 + 3 + 3 + 2}, fetched
        page = Tables()
        page.feed(html)
        for caption, group_by, key in (
            ("Per day", "day", "date"),
            ("Per team", "team", "team_id"),
            ("Per model", "model", "model"),
            ("Per tier", "tier", "tier"),
        ):
            assert page.tables[caption] == cells(report(db, group_by), key), caption
        days = report(db, "day")  # the charts draw the report's rows (their descriptions say so)
        labels = [d["date"] for d in days]
        assert page.descs["Time to first token (ms)"] == desc(
            charts.lines(
                "",
                labels,
                {
                    "P50": [d["ttft_p50_s"] * 1000 for d in days],
                    "P90": [d["ttft_p90_s"] * 1000 for d in days],
                },
                " ms",
            )
        )
        for title, field, unit in (
            ("Tokens per day", "total_tokens", ""),
            ("Spend per day (USD)", "cost_usd", " USD"),
            ("Requests per day", "requests", ""),
        ):
            assert page.descs[title] == desc(
                charts.bars("", labels, [d[field] for d in days], unit)
            ), title
        fetched.update(records=0, rows=0)
        for group_by in ("day", "team", "model", "tier", "user"):
            r = await client.get(f"/console/usage.csv?start={START}&end={END}&group_by={group_by}")
            assert r.status == 200 and (await r.read()).decode() == report(db, group_by, "csv"), (
                group_by
            )
        assert fetched["records"] == 0  # a grouped export reads groups too
        # the record export: the report's bytes, read a page at a time (700 + 1 to see the next)
        r = await client.get(f"/console/usage.csv?start={START}&end={END}&group_by=record")
        assert r.status == 200 and (await r.read()).decode() == report(db, "record", "csv")
        assert record_pages == [701, 701, 701, 701, 200], record_pages
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for query, param in (
            ("group_by=record&limit=0", "limit"),
            ("group_by=record&limit=10001", "limit"),
            ("after=1.0/r1", "after"),
            ("group_by=day&limit=5&after=1.0/r1", "after"),
            ("group_by=record&limit=5&after=nan/r1", "after"),
            ("group_by=record&limit=5&after=1.0", "after"),
        ):
            r = await client.get(f"/v1/usage?start={START}&end={END}&{query}", headers=admin)
            assert r.status == 400 and (await r.json())["error"]["param"] == param, query
        async with ClientSession() as anonymous:  # and nothing without a session
            r = await anonymous.get(
                client.make_url(f"/console/usage?start={START}&end={END}"), allow_redirects=False
            )
            assert r.status == 303 and r.headers["Location"] == "/console/login"


async def test_requests_page_reads_only_the_outliers(tiny_llama: Path, tmp_path: Path) -> None:
    """The Requests page lists the last 24 hours' failed requests and slowest tenth: the store
    picks them, so of 3000 records at most 100 leave it (the old page read all 3000)."""
    app = console_app(tiny_llama, tmp_path / "g.db")
    now = time.time()
    # the synthetic three days, squeezed into the last 20 hours
    records = [
        dataclasses.replace(r, created_at=now - 72000 + (r.created_at - DAY0) / (3 * 86400) * 72000)
        for r in synthetic(3000)
    ]
    async with TestClient(TestServer(app)) as client:
        store = app[STATE].store
        await fill(store, records)
        await sign_in(client)
        fetched = {"records": 0, "outliers": 0}
        usage_records, usage_outliers = store.usage_records, store.usage_outliers

        async def counted_records(*a: Any) -> Any:
            recs = await usage_records(*a)
            fetched["records"] += len(recs)
            return recs

        async def counted_outliers(*a: Any) -> Any:
            recs = await usage_outliers(*a)
            fetched["outliers"] += len(recs)
            return recs

        store.usage_records, store.usage_outliers = counted_records, counted_outliers  # type: ignore[method-assign]
        r = await client.get("/console/requests")
        html = await r.text()
        assert r.status == 200, html
        assert fetched == {"records": 0, "outliers": 100}, fetched
        page = Tables()
        page.feed(html)
        rows = page.tables["Slow or failed requests"]
        want = outliers(records, None, 100)
        assert [row[1] for row in rows] == [x.request_id for x in want]
        assert [row[5] for row in rows] == ["failed" if x.status != "ok" else "slow" for x in want]
        # the API it reads: outliers go with group_by=record, limit in [1, 1000], one team's own
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for query, param in (
            ("outliers=true", "outliers"),
            ("group_by=record&outliers=yes", "outliers"),
            ("group_by=record&outliers=true&limit=0", "limit"),
            ("group_by=record&outliers=true&limit=1001", "limit"),
            ("group_by=record&outliers=true&limit=x", "limit"),
        ):
            r = await client.get(f"/v1/usage?start={int(now) - 86400}&{query}", headers=admin)
            assert r.status == 400 and (await r.json())["error"]["param"] == param, query
        r = await client.get(
            f"/v1/usage?start={int(now) - 86400}&group_by=record&outliers=true&limit=1000"
            "&team_id=b",
            headers=admin,
        )
        assert [x["request_id"] for x in (await r.json())["data"]] == [
            x.request_id for x in outliers(records, "b", 1000)
        ]
