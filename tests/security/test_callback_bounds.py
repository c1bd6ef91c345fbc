"""Batch callbacks cost the gateway a bounded amount, whatever the receiver or its nameserver do.

- A delivery read the receiver's whole answer (10 s of an endless body: about a gigabyte per
  attempt); it now reads at most `MAX_ANSWER_BYTES` and drops the connection.
- Every due callback was sent at once; at most `MAX_CONCURRENT` run now, the rest wait a turn.
- `POST /v1/batch` resolved the callback's host on the request path (a slow nameserver a tenant
  names held the request and a resolver thread); a name is now resolved before each delivery,
  within `DNS_TIMEOUT_S`, and the request checks only what needs no DNS (a literal or
  `localhost` still gets its 400 there).

Real parts: receivers that are real HTTP servers on loopback (private callbacks allowed, as an
operator may), the sender the batch runner uses, and the batch routes' app on a real socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.batch.callback import MAX_CONCURRENT, CallbackSender
from gateway.batch.config import BatchConfig
from tests.batch.app import make_app
from tests.wait import until

Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
async def serve(aiohttp_server: Any) -> Serve:
    """serve(app) → the app's base URL on a loopback port (stopped at the test's end)."""

    async def start(app: web.Application) -> str:
        return str((await aiohttp_server(app, host="127.0.0.1")).make_url("")).rstrip("/")

    return start


@pytest.fixture
async def sender() -> AsyncIterator[CallbackSender]:
    s = CallbackSender(allow_private=True, timeout_s=5.0)
    yield s
    await s.close()


async def test_an_endless_answer_is_not_read(serve: Serve, sender: CallbackSender) -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        chunk = b"x" * 65536
        while True:  # until the client goes away
            await resp.write(chunk)

    app = web.Application()
    app.router.add_post("/hook", endless)
    url = await serve(app)
    delivered, detail = await sender.send(url + "/hook", "secret", b"{}", "evt-1")
    assert (delivered, detail) == (True, "HTTP 200")  # it read the answer to its 5 s timeout


async def test_deliveries_run_a_bounded_number_at_once(
    serve: Serve, sender: CallbackSender
) -> None:
    inflight, most = 0, 0
    release = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        nonlocal inflight, most
        inflight += 1
        most = max(most, inflight)
        try:
            await release.wait()
        finally:
            inflight -= 1
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/hook", held)
    url = await serve(app)
    sends = [
        asyncio.ensure_future(sender.send(url + "/hook", "secret", b"{}", f"evt-{i}"))
        for i in range(MAX_CONCURRENT * 2)
    ]
    await until(lambda: inflight >= MAX_CONCURRENT, 30, "the first deliveries to arrive")
    release.set()
    results = await asyncio.gather(*sends)
    assert all(ok for ok, _ in results), results
    assert most == MAX_CONCURRENT, most


async def test_the_request_path_does_no_dns(tmp_path: Path, serve: Serve) -> None:
    cfg = BatchConfig(data_dir=str(tmp_path), models=frozenset({"m"}), callback_secret="s")
    url = await serve(make_app(cfg))
    ok = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer key-a"}) as s:

        async def post(cb: str) -> tuple[int, Any]:
            async with s.post(url + "/v1/batch", json={"requests": [ok], "callback_url": cb}) as r:
                return r.status, await r.json()

        # a name is accepted unresolved: its lookup (and refusal) belong to the delivery
        status, body = await post("http://callbacks.no-such-host.invalid/hook")
        assert status == 202, body
        for refused in ("http://localhost:9000/hook", "http://127.0.0.1:9000/hook"):
            status, body = await post(refused)
            assert status == 400 and body["error"]["param"] == "callback_url", body
