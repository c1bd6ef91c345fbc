"""`GET /v1/usage` (a team's own usage) and the admin's view of every team's batches (teams
and keys: gateway/api/admin_teams.py).

- `GET /v1/usage?date=YYYY-MM-DD` (or `start=&end=`, dates or unix seconds;
  `group_by=model|day|team|tier|user|adapter|version|record`, user the requests' `user` field,
  record every request's usage record; a grouped row carries its TTFT P50/P90, all computed by
  the store; `team_id=`; with `group_by=record`, `outliers=true&limit=N` (1–1000, default 100):
  only the failed requests and the slowest tenth — latency at or above the range's nearest-rank
  P90, once it has 10 records — newest first, at most N, found by the store; without
  outliers, always one page of records in (created_at, request_id) order, `limit=N` of them
  (1–10000, default 1000), and `next`, the `after=` of the following page, null on the last):
  a team key reads its own team only (another team's id → 403); the admin key reads any
  team, or all of them.
- `GET /admin/batches[?team_id=&limit=]`: every team's batches (newest first, at most `limit`,
  default and maximum 100), each as `{team_id, batch}` with `batch` the OpenAI Batch object;
  `POST /admin/batches/{id}/cancel` cancels any team's batch (409 when it has ended). A team
  key keeps `/v1/batches`, which shows its own team only. 404 `batch_tier_off` when the gateway
  runs no batch tier.
"""

from __future__ import annotations

import asyncio
import calendar
import dataclasses
import math
import time
from typing import Any

import msgspec
from aiohttp import web

from gateway.accounts.store.base import GROUP_BY, UsageRecord
from gateway.accounts.store.batch_tables import BatchTables, Conflict
from gateway.api.admin_teams import json_response
from gateway.batch import wiring as batch_wiring
from gateway.batch.models import Batch
from gateway.batch.submit import batch_object
from gateway.state import GatewayState
from protocol.openai import APIError

_RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(UsageRecord))


def record_rows(records: list[UsageRecord]) -> list[dict[str, Any]]:
    """Usage records as report rows (the nodes as one space-separated field): the API's
    `group_by=record`, `duet usage report` and the console's CSV write these same rows. A shallow
    copy per record: `dataclasses.asdict` deep-copies every field, several times the cost, and
    this runs on the event loop."""
    rows = [{f: getattr(r, f) for f in _RECORD_FIELDS} for r in records]
    for row in rows:
        row["nodes"] = " ".join(row["nodes"])
    return rows


def parse_time(value: str, param: str) -> float:
    try:
        t = float(value)
    except ValueError:
        pass
    else:  # nan, inf and times past year 9999 are no time a store can compare with
        if math.isfinite(t) and abs(t) < 2.5e11:
            return t
        raise APIError(
            400, f"{param} must be a date (YYYY-MM-DD) or unix seconds, got {value!r}", param=param
        )
    try:
        return float(calendar.timegm(time.strptime(value, "%Y-%m-%d")))
    except ValueError:
        raise APIError(
            400, f"{param} must be a date (YYYY-MM-DD) or unix seconds, got {value!r}", param=param
        ) from None


def time_range(q: Any) -> tuple[float, float]:
    if "date" in q:
        start = parse_time(q["date"], "date")
        return start, start + 86400
    if "start" in q:
        start = parse_time(q["start"], "start")
        end = parse_time(q["end"], "end") if "end" in q else time.time() + 1
        if "end" in q and len(q["end"]) == 10 and "-" in q["end"]:
            end += 86400  # a date as the end means the whole day
        if end <= start:
            raise APIError(400, "end must be after start", param="end")
        return start, end
    today = time.time() // 86400 * 86400
    return today, today + 86400


#: `GET /v1/usage?group_by=record&outliers=true&limit=N`: N at most
OUTLIERS_MAX = 1000
#: `GET /v1/usage?group_by=record[&limit=N][&after=…]`: N at most, and N when not given
RECORDS_PAGE_MAX = 10_000
RECORDS_PAGE_DEFAULT = 1000


def _cursor(raw: str | None) -> tuple[float, str] | None:
    """A page's `next` (`<created_at>/<request_id>` of its last record) as the store's `after`."""
    if raw is None:
        return None
    t, sep, rid = raw.partition("/")
    try:
        at = float(t)
    except ValueError:
        at = math.nan
    if not sep or not rid or not math.isfinite(at):
        raise APIError(400, f"after must be a page's `next`, got {raw!r}", param="after")
    return at, rid


def _limit(q: Any, most: int, default: int = 100) -> int:
    """The query's `limit` (`default` when absent), an integer in [1, most]."""
    raw = q.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError:
        raise APIError(400, f"limit must be an integer, got {raw!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise APIError(400, f"limit must be between 1 and {most}", param="limit")
    return limit


async def usage(state: GatewayState, request: web.Request) -> web.Response:
    q = request.query
    team_id = q.get("team_id")
    team = await state.auth.admin_or_team(request)
    if team is not None:
        if team_id is not None and team_id != team.id:
            raise APIError(
                403,
                "this key may only read its own team's usage",
                type_="permission_error",
                code="forbidden",
                param="team_id",
            )
        team_id = team.id
    group_by = q.get("group_by")
    if group_by is not None and group_by not in (*GROUP_BY, "record"):
        raise APIError(
            400,
            f"group_by must be one of {', '.join(map(repr, (*GROUP_BY, 'record')))}",
            param="group_by",
        )
    start, end = time_range(q)
    if (
        "outliers" in q
    ):  # the failed and the slowest tenth, newest first (the console's Requests page)
        if group_by != "record" or q["outliers"] not in ("true", "1"):
            raise APIError(400, "outliers=true goes with group_by=record", param="outliers")
        limit = _limit(q, OUTLIERS_MAX)
        rows = record_rows(await state.store.usage_outliers(team_id, start, end, limit))
    elif "after" in q and group_by != "record":
        raise APIError(400, "after goes with group_by=record", param="after")
    elif group_by == "record":  # always one page: a team's whole history is no answer to send
        limit = _limit(q, RECORDS_PAGE_MAX, RECORDS_PAGE_DEFAULT)
        page = await state.store.usage_records(
            team_id, start, end, _cursor(q.get("after")), limit + 1
        )
        more = len(page) > limit
        page = page[:limit]
        answer = {
            "object": "list",
            "team_id": team_id,
            "start": start,
            "end": end,
            "group_by": group_by,
            "next": f"{page[-1].created_at!r}/{page[-1].request_id}" if more else None,
        }
        # a full page's rows and JSON off the loop too (a 10k page is ~0.2 s of CPU): the loop
        # thread keeps its turns while another thread holds the GIL for that long
        body = await asyncio.to_thread(
            lambda: msgspec.json.encode({**answer, "data": record_rows(page)})
        )
        return web.Response(body=body, content_type="application/json")
    else:
        rows = await state.store.usage(team_id, start, end, group_by)
    return json_response(
        {
            "object": "list",
            "team_id": team_id,
            "start": start,
            "end": end,
            "group_by": group_by,
            "data": rows,
        }
    )


# --- batches of every team ----------------------------------------------------------------------
class TeamBatch(msgspec.Struct, frozen=True, kw_only=True):
    """A batch as the admin lists it: OpenAI's Batch object has no owner, so it travels beside
    it."""

    team_id: str
    batch: Batch


class TeamBatchList(msgspec.Struct, frozen=True, kw_only=True):
    data: list[TeamBatch]
    #: more batches than `limit` matched
    has_more: bool
    object: str = "list"


def _batch_store(request: web.Request) -> tuple[BatchTables, Any]:
    if batch_wiring.RUNNER not in request.app:
        raise APIError(
            404, "this gateway runs no batch tier ([batch] enabled = false)", code="batch_tier_off"
        )
    runner = request.app[batch_wiring.RUNNER]
    return runner.store, runner.wake


async def list_batches(state: GatewayState, request: web.Request) -> web.Response:
    """Every team's batches: per team (the store reads batches by team), merged newest first.
    A deleted team's batches are not listed (its keys are gone and its batches with it)."""
    state.auth.require_admin(request)
    store, _ = _batch_store(request)
    limit = _limit(request.query, 100)
    team_id = request.query.get("team_id")
    teams = [team_id] if team_id else [t.id for t in await state.store.list_teams()]
    rows = []
    more = False
    for tid in teams:
        found, has_more = await store.list_batches(tid, None, limit)
        rows.extend(found)
        more = more or has_more
    rows.sort(key=lambda r: (r.created_at, r.id), reverse=True)
    data = [TeamBatch(team_id=r.team_id, batch=batch_object(r)) for r in rows[:limit]]
    return json_response(TeamBatchList(data=data, has_more=more or len(rows) > limit))


async def cancel_batch(state: GatewayState, request: web.Request) -> web.Response:
    state.auth.require_admin(request)
    store, wake = _batch_store(request)
    bid = request.match_info["id"]
    row = await store.get_batch(None, bid)
    if row is None:
        raise APIError(404, f"No such Batch: {bid!r}", param="id", code="not_found")
    try:
        cancelled = await store.cancel_batch(row.team_id, bid, time.time())
    except Conflict as e:
        raise APIError(409, str(e), code="batch_not_cancellable") from None
    if cancelled is None:  # removed between the two reads
        raise APIError(404, f"No such Batch: {bid!r}", param="id", code="not_found")
    wake()
    return json_response(TeamBatch(team_id=cancelled.team_id, batch=batch_object(cancelled)))
