"""Routing through coordinator replicas (`--coordinator URL,URL`): failover between replicas,
`exclude` after a failed node, the cluster's 503 passed on (its 404 as 503 no_capacity), and —
when no replica answers — the gateway's own least-loaded view, logged and counted.

(The test's own /route server runs on the test's event loop: the clients here are async.)
The coordinator is another issue's process; until it merges, a minimal `/route` server speaking
protocol.route stands in for it here (the lead adds coordinator-backed e2e tests). Nodes are
real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import openai
import pytest
from aiohttp import web

from protocol.route import RouteRequest, RouteResponse, RouteTarget
from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, metric, tiny_model
from tests.procs import Proc, free_port, running
from text.tokenizer import Tokenizer


class RouteServer:
    """Answers /route from a script: a list of (status, RouteResponse | error body)."""

    def __init__(self) -> None:
        self.seen: list[tuple[RouteRequest, str | None]] = []
        self.script: list[tuple[int, object]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _route(self, request: web.Request) -> web.Response:
        req = msgspec.json.decode(await request.read(), type=RouteRequest)
        self.seen.append((req, request.headers.get("X-Request-Id")))
        status, body = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        headers = {"Retry-After": "3"} if status == 503 else {}
        return web.Response(
            status=status,
            body=msgspec.json.encode(body),
            content_type="application/json",
            headers=headers,
        )

    async def start(self) -> RouteServer:
        app = web.Application()
        app.router.add_post("/route", self._route)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


@pytest.fixture
async def coord() -> AsyncIterator[RouteServer]:
    s = await RouteServer().start()
    yield s
    await s.stop()


def target(node: Proc, node_id: str) -> RouteTarget:
    return RouteTarget(node_id=node_id, url=node.url)


async def test_replica_failover_and_exclude(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, tmp_path: Path, coord: RouteServer
) -> None:
    p, d, _ = pd_nodes
    dead = f"http://127.0.0.1:{free_port()}"
    # first answer sends the decode leg to a dead node; the retry must exclude it
    coord.script = [
        (
            200,
            RouteResponse(
                prefill=target(p, "p1"),
                decode=RouteTarget(node_id="d-dead", url=dead),
                reason="test",
            ),
        ),
        (200, RouteResponse(prefill=target(p, "p1"), decode=target(d, "d1"), reason="test")),
    ]
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama)},
        routing={"coordinator": [f"http://127.0.0.1:{free_port()}", coord.url]},
    )
    with running(g):
        key = make_team(g.url, "c")
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        r = await client.completions.create(
            model=MODEL,
            prompt="route me " * 10,
            max_tokens=5,
            temperature=0,
            extra_headers={"x-duet-tier": "batch"},
        )
        assert r.choices[0].text is not None and r.usage.completion_tokens >= 1
    (first, rid1), (second, rid2) = coord.seen
    assert (
        first.model == MODEL
        and first.tier == "batch"
        and first.num_prompt_tokens == r.usage.prompt_tokens
    )
    assert len(first.block_hashes) == r.usage.prompt_tokens // 16 and first.max_tokens == 5
    assert first.exclude == [] and second.exclude == ["d-dead"]
    assert rid1 == rid2 == first.request_id and first.request_id.startswith("req-")


async def test_cluster_answers_are_passed_on(
    tiny_llama: Path, tmp_path: Path, coord: RouteServer
) -> None:
    g = gateway_proc(
        tmp_path, {MODEL: tiny_model(tiny_llama)}, routing={"coordinator": [coord.url]}
    )
    with running(g):
        prompt = "word " * 30
        n = len(Tokenizer(tiny_llama).encode(prompt))
        # one request fits; had a failed one kept its prompt tokens, the next would not
        key = make_team(g.url, "c", tpm=n + 20 + n // 2)
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        coord.script = [
            (
                503,
                {
                    "error": {
                        "message": "every node is full",
                        "type": "service_unavailable",
                        "param": None,
                        "code": "no_capacity",
                    }
                },
            )
        ]
        with pytest.raises(openai.APIStatusError) as e:
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
        assert e.value.status_code == 503 and e.value.response.headers["Retry-After"] == "3"
        assert "full" in e.value.message
        coord.script = [
            (
                404,
                {
                    "error": {
                        "message": "no node serves tiny",
                        "type": "invalid_request_error",
                        "param": "model",
                        "code": "model_not_found",
                    }
                },
            )
        ]
        for _ in range(2):  # a request no node served kept no tokens in the window: not a 429
            with pytest.raises(openai.APIStatusError) as e:
                await client.completions.create(model=MODEL, prompt=prompt, max_tokens=20)
            # no node registered for a model the gateway serves: a capacity outage, not a 404
            assert e.value.status_code == 503 and e.value.body["code"] == "no_capacity"
            assert "Retry-After" in e.value.response.headers
        rows = http(g.url + "/v1/usage", key=key)[2]["data"][0]
        assert rows["requests"] == 3 and rows["cost_usd"] == 0


async def test_no_coordinator_answers_static_view_serves(
    pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, tmp_path: Path
) -> None:
    p, d, _ = pd_nodes
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    g = gateway_proc(
        tmp_path,
        {MODEL: tiny_model(tiny_llama, prefill=[p.url], decode=[d.url])},
        routing={"coordinator": dead, "route_timeout_s": 1.0},
    )
    with running(g):
        key = make_team(g.url, "c")
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        r = await client.completions.create(
            model=MODEL, prompt="no coordinator", max_tokens=4, temperature=0
        )
        assert r.usage.completion_tokens >= 1
        assert metric(g.url, "duet:route_fallback_total") == 1
        assert "no coordinator answered" in g.log()
