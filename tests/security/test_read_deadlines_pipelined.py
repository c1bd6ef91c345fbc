"""The header deadline of a request whose first bytes came in the same read as the end of the
one before (runtime/read_deadlines.py), also where aiohttp's parser stopped short of that read
for flow control: a body over the reader's high-water mark (twice `read_bufsize`) that its
handler has not read yet, or more pipelined requests than aiohttp queues (32). There the read's last
byte is held until the parser has parsed what it kept — so these tests also show that holding it
loses nothing: a complete request that follows is answered.

tests/security/test_connections.py checks the plain case against a gateway process; here a
`DeadlineAppRunner` on a loopback port (the one every duet server uses) with a 1 s header
deadline, a 600 s idle timer and a small `read_bufsize` (a whole request comes in one read,
its body over the mark), and raw sockets: a connection closed within seconds was
closed by the header deadline. Before, the tests that end with an incomplete request waited
for the idle timer (they fail after 30 s).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web

from runtime.read_deadlines import DeadlineAppRunner, ReadDeadlines
from tests.procs import free_port
from tests.raw_http import RawConn, assert_timed_out

HEADER_S = 1.0
READ_BUFSIZE = 1024
#: over the body reader's high-water mark (2 × READ_BUFSIZE): its parser pauses mid-read
BIG = 10_000
#: more pipelined requests than aiohttp queues (32): its parser pauses between requests
MANY = 40
WITHIN_S = 30.0


async def _upload(request: web.Request) -> web.Response:
    return web.Response(text=str(len(await request.read())))


async def _ok(_: web.Request) -> web.Response:
    return web.Response(text="ok")


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    """A DeadlineAppRunner's server on its own thread's loop."""
    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/upload", _upload)
    app.router.add_get("/ok", _ok)
    loop = asyncio.new_event_loop()
    runner = DeadlineAppRunner(
        app,
        deadlines=ReadDeadlines(header_timeout_s=HEADER_S),
        keepalive_timeout=600.0,
        read_bufsize=READ_BUFSIZE,
    )
    p = free_port()
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", p).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield p
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


def _upload_request() -> bytes:
    return b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % BIG + b"x" * BIG


GET = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"
CASES = {
    "a large unread body": (_upload_request(), [str(BIG).encode()]),
    f"{MANY} pipelined requests": (GET * MANY, [b"ok"] * MANY),
}


def _answers(c: RawConn, want: list[bytes]) -> None:
    for i, body in enumerate(want):
        status, headers, got = c.response(WITHIN_S)
        assert (status, got) == (200, body), (i, status, got)
        assert headers.get("connection", "").lower() != "close", headers


@pytest.mark.parametrize("case", list(CASES))
def test_a_complete_request_after_is_answered(port: int, case: str) -> None:
    data, want = CASES[case]
    c = RawConn(port)
    try:
        c.send(data + GET)
        _answers(c, [*want, b"ok"])
        assert not c.closed()
    finally:
        c.close()


@pytest.mark.parametrize("case", list(CASES))
def test_the_first_bytes_of_a_request_after_have_a_header_deadline(port: int, case: str) -> None:
    data, want = CASES[case]
    c = RawConn(port)
    try:
        c.send(data + b"GET /o")  # and nothing more
        _answers(c, want)
        assert_timed_out(c, f"the request's headers did not arrive within {HEADER_S:g} s", WITHIN_S)
    finally:
        c.close()
