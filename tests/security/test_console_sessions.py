"""Console sessions: one key signing in again and again cannot sign others out, and cookies
are Secure behind a TLS-terminating proxy.

- Sessions were one LRU of 10,000 for every key, and sign-ins with a valid key were unlimited:
  a team key signing in in a loop pushed the admin's and every other session out. Now a key
  holds at most `MAX_PER_KEY` sessions; signing in once more ends that key's own oldest.
- Cookies were `Secure` only when this socket spoke TLS, so behind an ingress that terminates
  it they travelled without. A trusted proxy's `X-Forwarded-Proto: https` (`[server]
  trusted_proxies`), or `[server] secure_cookies`, makes them Secure; an untrusted peer's
  header does not.

Real parts: the gateway's app on a real socket, its console signing in through its own API.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.keys import new_key
from gateway.accounts.store.base import Team
from gateway.app import STATE, make_app
from gateway.config import parse_config
from gateway.console.session import MAX_PER_KEY
from tests.gateway.helpers import ADMIN_KEY

Gateway = Callable[..., Any]


@pytest.fixture
def gateway(tiny_llama: Path, tmp_path: Path) -> Gateway:
    @asynccontextmanager
    async def start(**server: Any) -> AsyncIterator[TestClient]:
        cfg = parse_config(
            {
                "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
                "server": {
                    "admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),
                    **server,
                },
                "models": {
                    "tiny": {
                        "tokenizer": str(tiny_llama),
                        "static": {"both": ["http://127.0.0.1:9"]},
                    }
                },
            }
        )
        async with TestClient(TestServer(make_app(cfg))) as client:
            yield client

    return start


def _browser(client: TestClient) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        base_url=client.make_url(""), cookie_jar=aiohttp.CookieJar(unsafe=True)
    )


async def _sign_in(browser: aiohttp.ClientSession, key: str) -> None:
    form = await (await browser.get("/console/login")).text()
    token = re.search(r'name="csrf" value="([^"]+)"', form)
    assert token, form
    r = await browser.post(
        "/console/login", data={"csrf": token.group(1), "key": key}, allow_redirects=False
    )
    assert r.status == 303, await r.text()


async def _page(browser: aiohttp.ClientSession) -> int:
    async with browser.get("/console/usage", allow_redirects=False) as r:
        return r.status


async def test_one_key_signing_in_in_a_loop_ends_only_its_own_sessions(
    gateway: Gateway,
) -> None:
    async with gateway() as client:
        store = client.app[STATE].store
        await store.create_team(Team(id="loud"))
        key, secret, digest = new_key("loud")
        await store.create_key(key, digest)
        admin, first = _browser(client), _browser(client)
        try:
            await _sign_in(admin, ADMIN_KEY)
            await _sign_in(first, secret)
            assert await _page(first) == 200
            for _ in range(MAX_PER_KEY):
                async with _browser(client) as again:
                    await _sign_in(again, secret)
            assert await _page(first) == 303, "the key's oldest session ended"
            assert await _page(admin) == 200, "another key's session goes on"
        finally:
            await admin.close()
            await first.close()


def _cookie_flags(r: aiohttp.ClientResponse) -> str:
    return next(v for v in r.headers.getall("Set-Cookie") if v.startswith("duet_console_login="))


@pytest.mark.parametrize(
    ("server", "proto", "secure"),
    [
        ({"trusted_proxies": ["127.0.0.1"]}, "https", True),
        ({"trusted_proxies": ["127.0.0.1"]}, None, False),
        ({"trusted_proxies": ["10.0.0.0/8"]}, "https", False),  # not a trusted peer
        ({"secure_cookies": True}, None, True),
    ],
)
async def test_cookies_are_secure_behind_a_tls_proxy(
    gateway: Gateway, server: dict[str, Any], proto: str | None, secure: bool
) -> None:
    async with gateway(**server) as client:
        headers = {"X-Forwarded-Proto": proto} if proto else {}
        async with client.get("/console/login", headers=headers) as r:
            flags = _cookie_flags(r).lower()
        assert ("; secure" in flags) == secure, flags
