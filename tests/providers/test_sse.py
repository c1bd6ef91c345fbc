"""The SSE reader on a real HTTP response: CRLF and LF line ends, multi-line data, comments,
events split across TCP writes, EOF, and the line-length cap."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from aiohttp import web

from gateway.backends.providers import ProviderError
from gateway.backends.providers.sse import sse_events


def raw_app(pieces: list[bytes]) -> web.Application:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for p in pieces:
            await resp.write(p)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/", handler)
    return app


async def read(
    aiohttp_client: Callable, pieces: list[bytes], max_line: int = 1 << 20
) -> list[tuple[str | None, str]]:  # type: ignore[type-arg]
    client = await aiohttp_client(raw_app(pieces))
    resp = await client.get("/")
    loop = asyncio.get_running_loop()
    return [e async for e in sse_events(resp.content, loop.time() + 5, 5, max_line=max_line)]


async def test_line_ends_multiline_comments_and_splits(aiohttp_client: Callable) -> None:  # type: ignore[type-arg]
    got = await read(
        aiohttp_client,
        [
            b": keep-alive\r\n\r\n",
            b"event: a\r\ndata: one\r\n",
            b"data: two\r\n\r\n",
            b'data: {"x"',
            b": 1}\n\n",
            b"event: b\ndata:no-space\n\n",
            b"data: partial-without-blank-line",
        ],
    )
    assert got == [("a", "one\ntwo"), (None, '{"x": 1}'), ("b", "no-space")]


async def test_overlong_line_is_refused(aiohttp_client: Callable) -> None:  # type: ignore[type-arg]
    with pytest.raises(ProviderError) as e:
        await read(aiohttp_client, [b"data: " + b"x" * 5000], max_line=1000)
    assert e.value.kind == "invalid_response"
