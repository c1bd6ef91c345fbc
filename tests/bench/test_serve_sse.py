"""bench.sse_client against the synthetic latency server (real HTTP on loopback): what it
records for a good stream (chat and completions, with and without usage) and the cause it
gives each kind of failure, without ever raising."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.latency_server import LatencyConfig, make_app
from bench.records import RequestRecord
from bench.sse_client import send
from tests.procs import free_port

Server = Callable[..., Awaitable[TestServer]]
BODY = {
    "prompt": [5, 6, 7],
    "max_tokens": 4,
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def one(
    server: TestServer,
    body: dict[str, Any] = BODY,
    path: str = "/v1/completions",
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
) -> RequestRecord:
    rec = RequestRecord(index=0, prompt_len=3, max_tokens=4, scheduled_s=0.0)
    async with aiohttp.ClientSession() as s:
        return await send(
            s, str(server.make_url(path)), body, headers or {}, rec, timeout, time.perf_counter()
        )


async def test_good_stream_timing_and_usage(aiohttp_server: Server) -> None:
    server = await aiohttp_server(
        make_app(LatencyConfig(ttft_ms=60, itl_ms=25, tokens_per_chunk=2, output_len=5))
    )
    r = await one(server)
    assert r.ok and r.cause is None
    assert r.output_tokens == 5 and r.usage_tokens and r.usage_prompt_tokens == 3
    assert len(r.chunk_s) == 3 and r.chunk_tokens == [1, 1, 1]  # no token_ids: a chunk counts 1
    assert r.ttft_s is not None and r.ttft_s >= 0.060 and r.ttft_s == r.chunk_s[0]
    # chunk k leaves the server at arrival + 60 ms + k x 25 ms (absolute deadlines), so it
    # reaches the client no earlier; individual gaps are not bounded (a late chunk shortens the
    # next)
    assert (
        all(t >= 0.060 + 0.025 * k for k, t in enumerate(r.chunk_s)) and r.e2el_s >= r.chunk_s[-1]
    )
    assert len(r.itl_s) == 2 and r.itl_s[0] == r.chunk_s[1] - r.chunk_s[0]
    assert r.tpot_s == pytest.approx((r.e2el_s - r.ttft_s) / 4)


async def test_without_usage_tokens_are_counted_from_the_stream(aiohttp_server: Server) -> None:
    server = await aiohttp_server(make_app(LatencyConfig(ttft_ms=1, itl_ms=1, usage=False)))
    r = await one(server)
    assert r.ok and not r.usage_tokens and r.output_tokens == 4


async def test_chat_stream_ignores_the_empty_role_chunk(aiohttp_server: Server) -> None:
    server = await aiohttp_server(make_app(LatencyConfig(ttft_ms=40, itl_ms=1)))
    body = {
        "messages": [{"role": "user", "content": "hi there"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = await one(server, body, "/v1/chat/completions")
    assert (
        r.ok
        and r.output_tokens == 3
        and len(r.chunk_s) == 3
        and r.ttft_s is not None
        and r.ttft_s >= 0.040
    )


@pytest.mark.parametrize(
    ("config", "cause"),
    [
        (LatencyConfig(fail_every=1, fail_status=503), "http_503"),
        (LatencyConfig(api_keys=("k",)), "http_401"),
        (LatencyConfig(sse_error_every=1, ttft_ms=1, itl_ms=1), "sse_error"),
        (LatencyConfig(truncate_every=1, ttft_ms=1, itl_ms=1), "incomplete_stream"),
        (LatencyConfig(hang_every=1, hang_s=30), "timeout"),
    ],
)
async def test_failure_causes(aiohttp_server: Server, config: LatencyConfig, cause: str) -> None:
    server = await aiohttp_server(make_app(config))
    r = await one(server, timeout=0.5)
    assert not r.ok and r.cause == cause and r.message
    if cause == "http_503":
        assert "injected failure" in r.message  # the OpenAI error body's message is kept


async def test_connection_refused_is_a_connection_error() -> None:
    rec = RequestRecord(index=0, prompt_len=1, max_tokens=1, scheduled_s=0.0)
    async with aiohttp.ClientSession() as s:
        r = await send(
            s,
            f"http://127.0.0.1:{free_port()}/v1/completions",
            BODY,
            {},
            rec,
            5.0,
            time.perf_counter(),
        )
    assert r.cause == "connection_error"


async def test_malformed_streams(aiohttp_server: Server) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {not json\n\n")
        return resp

    async def empty(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": ""}]}\n\ndata: [DONE]\n\n')
        return resp

    async def not_streamed(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "all at once"}]})

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://example.invalid/")

    app = web.Application()
    app.router.add_post("/garbage", garbage)
    app.router.add_post("/empty", empty)
    app.router.add_post("/redirect", redirect)
    app.router.add_post("/not-streamed", not_streamed)
    server = await aiohttp_server(app)
    assert (await one(server, path="/garbage")).cause == "bad_response"
    assert (await one(server, path="/empty")).cause == "no_output"
    assert (await one(server, path="/redirect")).cause == "http_302"  # never followed
    r = await one(server, path="/not-streamed")
    assert r.cause == "bad_response" and "text/event-stream" in r.message


def _late_end_app(peers: list[object], end_after_s: float | None) -> web.Application:
    """A server that ends its body `end_after_s` after `[DONE]`, in a send of its own (as vLLM's
    server may: the two arrive in separate reads), or never (None); notes each request's peer."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": " a"}]}\n\ndata: [DONE]\n\n')
        if end_after_s is None:
            await asyncio.Event().wait()  # a broken server: the body never ends
        await asyncio.sleep(
            end_after_s
        )  # the server's behaviour under test, not a wait for the client
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def test_a_body_ending_after_done_keeps_the_connection(aiohttp_server: Server) -> None:
    # A client that stops reading at [DONE] releases the response mid-body, and aiohttp closes
    # the connection: against such a server every request paid a new one inside its TTFT.
    peers: list[object] = []
    server = await aiohttp_server(_late_end_app(peers, 0.02))
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            rec = RequestRecord(index=0, prompt_len=3, max_tokens=4, scheduled_s=0.0)
            r = await send(
                s, str(server.make_url("/v1/completions")), BODY, {}, rec, 10.0, time.perf_counter()
            )
            assert r.ok and r.output_tokens == 1
    assert len(peers) == 3 and len(set(peers)) == 1, peers  # before: three connections


async def test_a_body_that_never_ends_after_done_still_completes(aiohttp_server: Server) -> None:
    peers: list[object] = []
    server = await aiohttp_server(_late_end_app(peers, None))
    r = await one(server, timeout=30.0)
    assert r.ok and r.output_tokens == 1  # the answer was whole: only its connection is given up
