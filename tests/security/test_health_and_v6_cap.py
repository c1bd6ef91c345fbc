"""What the gateway's listener gives away and whom it counts as one client:

- `GET /health` without a credential is a status and nothing else (no models, no queue depths,
  no batch worker named by its host); with the admin key it keeps its details;
- the per-address connection cap counts an IPv6 client by its /64 (one host routinely owns a
  whole /64: a cap per full address is no cap), an IPv4-mapped address as its IPv4.

Real parts: the gateway app on a real socket in this process; for the cap, the gateway's own
runner (`LimitedAppRunner`) on the IPv6 loopback with real TCP connections. The loopback is one
address, so the many addresses of one /64 are shown through `client_of`, the key every
connection is counted under.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from gateway.app import make_app
from gateway.config import parse_config
from gateway.conn_limits import LimitedAppRunner, client_of
from runtime.read_deadlines import ReadDeadlines
from tests.gateway.helpers import ADMIN_KEY
from tests.wait import until


async def test_health_shows_only_a_status_without_a_credential(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
            "server": {"admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest()},
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    async with TestClient(TestServer(make_app(cfg))) as client:
        r = await client.get("/health")
        assert r.status == 200 and await r.json() == {"status": "ok"}
        r = await client.get("/health", headers={"Authorization": "Bearer sk-duet-nobody"})
        assert r.status == 200 and await r.json() == {"status": "ok"}
        r = await client.get("/health", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        body = await r.json()
        assert body["models"] == ["tiny"] and body["waiting"] == {"interactive": 0, "batch": 0}
        assert body["batch"]["worker_id"] == body["batch"]["worker_id"].strip() != ""


def test_an_ipv6_client_counts_by_its_64() -> None:
    one_64 = {client_of(f"2001:db8:1:2:{i:x}:0:0:{i:x}") for i in range(1, 500)}
    assert one_64 == {"2001:db8:1:2::/64"}
    assert client_of("2001:db8:1:3::1") == "2001:db8:1:3::/64"  # the next /64: another client
    assert client_of("fe80::1%eth0") == "fe80::/64"
    assert client_of("::ffff:192.0.2.7") == "192.0.2.7"  # IPv4-mapped: the IPv4 client
    assert client_of("192.0.2.7") == "192.0.2.7"


async def test_the_cap_counts_real_ipv6_connections_under_their_64() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 loopback")

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    runner = LimitedAppRunner(app, max_connections_per_address=2, deadlines=ReadDeadlines())
    await runner.setup()
    try:
        site = web.TCPSite(runner, "::1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        conns = [await asyncio.open_connection("::1", port) for _ in range(3)]
        # two counted under ::1's /64, the third closed before a byte of it is read
        assert await asyncio.wait_for(conns[2][0].read(1), 10) == b""
        await until(lambda: runner._gate.open == {"::/64": 2}, 10, "two counted connections")
        for _, w in conns:
            w.close()
        await until(lambda: runner._gate.open == {}, 10, "every connection uncounted")
    finally:
        await runner.cleanup()
