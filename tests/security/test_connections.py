"""The gateway's listener against slow and greedy clients (issue #22): a client address holds
at most `[server] max_connections_per_address` open connections (more are closed at once),
and a connection that has not sent a whole request's headers within `header_timeout_s`
(slowloris) is closed. Before, any number of idle or trickling sockets stayed open for
aiohttp's keep-alive timer, each a descriptor of the gateway.

Real parts: a `duet gateway` process, raw TCP sockets, and real HTTP for a client that behaves.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.gateway.helpers import MODEL, gateway_proc, http, tiny_model
from tests.procs import Proc, running
from tests.wait import wait_for

CAP = 3


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("conns")
    server = {"max_connections_per_address": CAP, "header_timeout_s": 3.0}
    g = gateway_proc(tmp, {MODEL: tiny_model(tiny_llama, both=["http://127.0.0.1:9"])}, server=server)
    with running(g):
        yield g


def _closed(s: socket.socket) -> bool:
    """True once the gateway closed `s` (a read sees EOF or a reset), False while it is open."""
    s.settimeout(0.05)
    try:
        return s.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _connect(gw: Proc) -> socket.socket:
    return socket.create_connection(("127.0.0.1", gw.port), timeout=5)


def test_connections_per_address_are_capped_and_slow_headers_dropped(gw: Proc) -> None:
    held = [_connect(gw) for _ in range(CAP)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # headers never finished: slowloris
        extra = _connect(gw)
        try:
            wait_for(lambda: _closed(extra), 10, "the connection over the cap to be closed")
        finally:
            extra.close()
        assert not any(_closed(s) for s in held)  # the first CAP are open until their deadline
        wait_for(lambda: all(_closed(s) for s in held), 15, "trickling connections to be closed")
    finally:
        for s in held:
            s.close()
    # Their slots are free again: a client that behaves is served.
    status, _, body = http(f"{gw.url}/health", key=None)
    assert status == 200, body


def test_refused_connections_cannot_flood_the_log(gw: Proc) -> None:
    """Each connection over the cap was one log line: a client could write lines as fast as it
    opened sockets. Now one line per 10 s, the rest counted into the next."""
    held = [_connect(gw) for _ in range(CAP)]
    try:
        before = gw.log().count("refused a connection from")
        for _ in range(40):
            extra = _connect(gw)
            try:
                wait_for(lambda s=extra: _closed(s), 10, "the connection over the cap to be closed")  # type: ignore[misc]
            finally:
                extra.close()
        assert gw.log().count("refused a connection from") - before <= 2  # 40 refusals, within a 10 s window or two
    finally:
        for s in held:
            s.close()
