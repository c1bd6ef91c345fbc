"""A connect to a node that "times out" only because this process's own event loop stood
still (a burst of thousands of requests can hold one loop iteration for seconds) is not the
node's failure: NodeClient tries it once more. One that times out while the loop ran freely
(a node that does not answer) still fails at once. LoopLag measures the stall, the one going
on included."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import aiohttp
import pytest
import uvloop
from aiohttp import web

from gateway.backends.loop_lag import INTERVAL_S, LoopLag
from gateway.backends.node_client import NodeClient, NodeFailure
from protocol.node_api import NodeCompletionRequest

_BODY = NodeCompletionRequest(prompt=[1])

CONNECT_TIMEOUT_S = 0.3


def _node() -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write_eof(
            b'data: {"choices": [{"text": "hi", "token_ids": [1]}]}\n\ndata: [DONE]\n\n'
        )
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _lag() -> tuple[LoopLag, asyncio.Task[None]]:
    lag = LoopLag()
    task = asyncio.ensure_future(lag.run())
    await asyncio.sleep(INTERVAL_S * 2)
    return lag, task


async def test_loop_lag_counts_the_stall_going_on_and_past_ones() -> None:
    lag, _ = await _lag()
    t0 = time.monotonic()
    assert lag.stalled_since(t0) < 0.05
    time.sleep(0.3)  # the loop stands still (this test blocks it on purpose)
    assert lag.stalled_since(t0) >= 0.2  # seen while it goes on: the heartbeat is overdue
    await asyncio.sleep(INTERVAL_S * 2)
    assert lag.stalled_since(t0) >= 0.2  # and remembered once it is over
    assert lag.stalled_since(time.monotonic()) < 0.05  # nothing after it


def test_a_connect_timed_out_by_our_own_stall_is_retried() -> None:
    """Under uvloop, as the gateway runs: libuv runs expired timers before it polls the
    sockets, so after a long iteration a connect's timeout fires although the connect itself
    completed long before (asyncio's own loop polls first and would not show it)."""

    async def main() -> int:
        runner = web.AppRunner(_node())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        lag, _ = await _lag()
        loop = asyncio.get_running_loop()

        stalls = [CONNECT_TIMEOUT_S * 2]

        async def stall(*_: object) -> None:
            # the first connect is about to start: once it waits for its socket, the loop
            # stands still past the connect timeout, as a burst's one long iteration does
            if stalls:
                loop.call_soon(time.sleep, stalls.pop())

        trace = aiohttp.TraceConfig()
        trace.on_connection_create_start.append(stall)
        try:
            async with aiohttp.ClientSession(trace_configs=[trace]) as s:
                nc = NodeClient(s, CONNECT_TIMEOUT_S, 5.0, 5.0, lag)
                texts = [
                    c.choices[0].text
                    async for c, _ in nc.stream(f"http://127.0.0.1:{port}", "r1", _BODY)
                ]
                assert texts == ["hi"]
                return nc.own_stall_retries
        finally:
            await runner.cleanup()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
        assert r.run(main()) == 1  # timed out on our side, tried again, served


async def test_a_node_that_does_not_answer_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # a listening socket that never accepts, its backlog full: connects to it hang in SYN
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    port = lst.getsockname()[1]
    fillers = []
    for _ in range(8):  # fill the accept queue so the next connect waits
        f = socket.socket()
        f.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            f.connect(("127.0.0.1", port))
        fillers.append(f)
    lag, _ = await _lag()
    try:
        async with aiohttp.ClientSession() as s:
            nc = NodeClient(s, CONNECT_TIMEOUT_S, 5.0, 5.0, lag)
            t0 = time.monotonic()
            with pytest.raises(NodeFailure, match="ConnectionTimeoutError"):
                async for _ in nc.stream(f"http://127.0.0.1:{port}", "r1", _BODY):
                    pass
            assert nc.own_stall_retries == 0
            assert time.monotonic() - t0 < CONNECT_TIMEOUT_S * 3  # no second wait
    finally:
        for f in fillers:
            f.close()
        lst.close()
