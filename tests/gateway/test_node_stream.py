"""The node stream is read by network reads, not lines. `DataLines` cuts any split of a stream
into the same payloads (hypothesis) and says what arrived together; NodeClient.stream against
a real aiohttp server relays every chunk in order with `more` set only when its successor was
in the same read, refuses a stream cut before `[DONE]` and an endless line, and surfaces an SSE
error event as a NodeFailure — unless the node says the request itself cannot be computed (its
own fault: every node would fail it the same), which is the client's 400 with the node's
words, never a failure to retry elsewhere or migrate."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gateway.backends.base import midstream
from gateway.backends.node_client import NodeClient, NodeFailure
from gateway.batch.contracts import RETRYABLE_STATUS
from gateway.serving.relay import broke_off
from node.responder import request_failed
from protocol import sse
from protocol.node_api import NodeCompletionRequest
from protocol.openai import APIError
from protocol.outputs import Fault, RequestOutput
from protocol.sse import DataLines
from tests.wait import until


def _event(i: int) -> bytes:
    return (
        b"data: "
        + json.dumps({"choices": [{"index": 0, "text": f" t{i}", "token_ids": [i]}]}).encode()
        + b"\n\n"
    )


def _server(writes: list[bytes], gate: asyncio.Event | None = None) -> web.Application:
    """A node that sends `writes` as separate writes; waits for `gate` before the last one."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for k, w in enumerate(writes):
            if gate is not None and k == len(writes) - 1:
                await gate.wait()
            await resp.write(w)
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _read(aiohttp_server, app: web.Application, on_chunk=None) -> list[tuple[str, bool]]:  # type: ignore[no-untyped-def]
    server = await aiohttp_server(app)
    async with aiohttp.ClientSession() as s:
        nc = NodeClient(s, 5.0, 5.0, 5.0)
        out = []
        async for chunk, more in nc.stream(
            str(server.make_url("")).rstrip("/"), "r1", NodeCompletionRequest(prompt=[1])
        ):
            out.append((chunk.choices[0].text, more))
            if on_chunk is not None:
                on_chunk(len(out))
        return out


@given(
    st.lists(st.integers(min_value=0, max_value=10**6), min_size=1, max_size=8),
    st.lists(st.integers(min_value=0, max_value=2000), max_size=12),
)
def test_any_split_of_a_stream_gives_the_same_payloads(ids: list[int], cuts: list[int]) -> None:
    stream = b"".join(_event(i) for i in ids) + b"data: [DONE]\n\n"
    bounds = sorted({min(c, len(stream)) for c in cuts} | {0, len(stream)})
    lines = DataLines()
    got = [p for a, b in itertools.pairwise(bounds) for p in lines.feed(stream[a:b])]
    assert got[-1] == b"[DONE]"
    assert [json.loads(p)["choices"][0]["token_ids"][0] for p in got[:-1]] == ids


def test_what_arrived_together_comes_back_together() -> None:
    lines = DataLines()
    assert len(lines.feed(_event(0) + _event(1) + _event(2)[:9])) == 2
    assert len(lines.feed(_event(2)[9:])) == 1
    assert lines.feed(b"") == []


def test_an_endless_line_is_refused() -> None:
    lines = DataLines(max_line=100)
    lines.feed(b"data: " + b"x" * 90)
    with pytest.raises(ValueError, match="over 100 bytes"):
        lines.feed(b"x" * 20)


async def test_the_client_relays_in_order_and_marks_bursts(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    writes = [_event(0) + _event(1) + _event(2), b"data: [DONE]\n\n"]
    gate = asyncio.Event()
    # [DONE] waits until the client has read the burst: it cannot ride in the burst's read
    out = await _read(
        aiohttp_server, _server(writes, gate), on_chunk=lambda n: n == 3 and gate.set()
    )
    assert out == [(" t0", True), (" t1", True), (" t2", False)]


async def test_a_stream_cut_before_done_fails(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NodeFailure, match="before \\[DONE\\]"):
        await _read(aiohttp_server, _server([_event(0), _event(1)[:10]]))


async def test_an_error_event_fails(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    err = b'data: {"error": {"message": "engine died"}}\n\n'
    with pytest.raises(NodeFailure, match="engine died"):
        await _read(aiohttp_server, _server([_event(0), err, b"data: [DONE]\n\n"]))


def _failed(fault: Fault) -> bytes:
    """The error event a node sends when the engine failed the request (node/responder.py)."""
    out = RequestOutput("r1", [], "", True, "error", error="the row is not finite", fault=fault)
    return sse.error_event(request_failed(out)) + sse.DONE


async def test_the_requests_own_failure_is_the_clients_400(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    """Mid-stream (after a token went out) or before any: an APIError 400 with the node's
    message, type and code — not a NodeFailure, which the cluster backend retries on another
    node or migrates (each computing the prompt again and failing the same). A whole answer
    (a batch line's) that broke off so is that 400 too, which the batch tier does not retry."""
    for writes in ([_event(0), _failed(Fault.REQUEST)], [_failed(Fault.REQUEST)]):
        got: list[int] = []
        with pytest.raises(APIError) as e:
            await _read(aiohttp_server, _server(writes), got.append)
        assert not isinstance(e.value, NodeFailure)
        assert (e.value.status, e.value.type, e.value.code) == (
            400,
            "invalid_request_error",
            "request_invalid",
        )
        assert "the row is not finite" in e.value.message
        assert len(got) == len(writes) - 1  # the tokens before it were relayed
        whole = broke_off(midstream(e.value))
        assert (whole.status, whole.code, whole.message) == (
            400,
            "request_invalid",
            e.value.message,
        )
        assert whole.status not in RETRYABLE_STATUS


async def test_the_engines_own_failure_is_still_the_nodes(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NodeFailure, match="the row is not finite") as e:
        await _read(aiohttp_server, _server([_event(0), _failed(Fault.ENGINE)]))
    assert broke_off(midstream(e.value)).status == 502  # a batch line runs again later


async def test_the_client_refuses_an_endless_line(
    aiohttp_server, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sse, "MAX_LINE", 4096)
    with pytest.raises(NodeFailure, match="SSE line over 4096 bytes"):
        # the line's end never comes (its write waits for a gate nobody opens)
        await _read(aiohttp_server, _server([b"data: {" + b"x" * 5000, b"}\n\n"], asyncio.Event()))


def _late_end_server(peers: list[object], end: asyncio.Event) -> web.Application:
    """A node that sends `[DONE]`, then ends its body only once `end` is set (a node, or a
    vLLM server, whose last two writes arrive in separate reads); notes each request's peer."""

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(_event(0) + b"data: [DONE]\n\n")
        await end.wait()
        end.clear()
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def _late_end_node(aiohttp_server) -> tuple[str, list[object], asyncio.Event]:  # type: ignore[no-untyped-def]
    """A running `_late_end_server`: its URL, the peers it saw, the event that ends a body."""
    peers: list[object] = []
    end = asyncio.Event()
    server = await aiohttp_server(_late_end_server(peers, end))
    return str(server.make_url("")).rstrip("/"), peers, end


async def test_a_body_ending_after_done_keeps_its_connection(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    url, peers, end = await _late_end_node(aiohttp_server)
    async with aiohttp.ClientSession() as s:
        nc = NodeClient(s, 5.0, 5.0, 5.0)
        for _ in range(3):
            texts = [
                c.choices[0].text
                async for c, _ in nc.stream(url, "r1", NodeCompletionRequest(prompt=[1]))
            ]
            assert texts == [" t0"]  # the stream is over for the caller before the body ends
            assert nc.draining == 1
            end.set()  # now the body's end arrives, in a later read than [DONE]
            await until(lambda: nc.draining == 0)
    # every request went over the first connection (before: each release mid-body closed it)
    assert len(peers) == 3 and len(set(peers)) == 1, peers


async def test_a_body_that_never_ends_loses_its_connection(aiohttp_server) -> None:  # type: ignore[no-untyped-def]
    url, peers, end = await _late_end_node(aiohttp_server)
    async with aiohttp.ClientSession() as s:
        nc = NodeClient(s, 5.0, 5.0, 5.0)
        nc.drain_timeout_s = 0.05
        assert [
            c.choices[0].text
            async for c, _ in nc.stream(url, "r1", NodeCompletionRequest(prompt=[1]))
        ] == [" t0"]
        await until(lambda: nc.draining == 0)  # gave up: the connection was closed, not pooled
        end.set()
        assert [
            c.choices[0].text
            async for c, _ in nc.stream(url, "r2", NodeCompletionRequest(prompt=[1]))
        ] == [" t0"]
        assert len(set(peers)) == 2  # the second request needed a new connection
        await nc.close()  # at shutdown: a drain still going is stopped
        assert nc.draining == 0
