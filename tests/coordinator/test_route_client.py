"""coordinator/client.py: the one rule for a final answer from a coordinator replica, and the
client following it against real HTTP servers (aiohttp on free loopback ports)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web

from coordinator.client import CoordinatorUnavailable, RouteClient, RouteError, Verdict, verdict
from protocol.openai import APIError
from protocol.route import RouteRequest, RouteResponse, RouteTarget
from runtime.ports import free_port

REQ = RouteRequest(model="m", block_hashes=[], num_prompt_tokens=4, max_tokens=2)
OK = RouteResponse(prefill=None, decode=RouteTarget(node_id="d", url="http://d"), reason="test")


@pytest.mark.parametrize(
    ("status", "code", "want"),
    [
        (200, None, Verdict.ANSWER),
        (400, None, Verdict.FINAL_ERROR),
        (401, None, Verdict.FINAL_ERROR),
        (404, "model_not_found", Verdict.FINAL_ERROR),
        (415, None, Verdict.FINAL_ERROR),
        (503, "no_capacity", Verdict.FINAL_ERROR),
        (503, None, Verdict.TRY_NEXT),
        (500, None, Verdict.TRY_NEXT),
        (502, "no_capacity", Verdict.TRY_NEXT),
    ],
)
def test_the_one_rule(status: int, code: str | None, want: Verdict) -> None:
    assert verdict(status, code) is want


async def _server(
    status: int, body: object, seen: list[str], name: str
) -> tuple[web.AppRunner, str]:
    async def route(request: web.Request) -> web.Response:
        seen.append(name)
        return web.Response(
            status=status,
            body=msgspec.json.encode(body),
            content_type="application/json",
            headers={"Retry-After": "2"} if status == 503 else {},
        )

    app = web.Application()
    app.router.add_post("/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_moves_on_from_a_sick_replica_stops_at_an_answer(
    session: aiohttp.ClientSession,
) -> None:
    seen: list[str] = []
    full = APIError(503, "full", type_="service_unavailable", code="no_capacity").body()
    sick_r, sick = await _server(503, APIError(503, "starting").body(), seen, "sick")
    full_r, full_url = await _server(503, full, seen, "full")
    ok_r, ok = await _server(200, OK, seen, "ok")
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        assert (await RouteClient([dead, sick, ok], session).route(REQ)) == OK
        assert seen == ["sick", "ok"]
        seen.clear()
        with pytest.raises(RouteError) as e:  # the cluster's answer: not retried on `ok`
            await RouteClient([full_url, ok], session).route(REQ)
        assert (e.value.status, e.value.code, e.value.retry_after_s) == (503, "no_capacity", 2.0)
        assert seen == ["full"]
        urls: list[str] = []
        with pytest.raises(CoordinatorUnavailable, match="no coordinator replica is known"):
            await RouteClient(lambda: urls, session).route(REQ)
        urls.append(ok)  # a replica found later (etcd) is used from the next request on
        assert (await RouteClient(lambda: urls, session).route(REQ)) == OK
    finally:
        for r in (sick_r, full_r, ok_r):
            await r.cleanup()
