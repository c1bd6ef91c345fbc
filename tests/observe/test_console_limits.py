"""The console's rate limit (gateway/console/limits.py): a flood of page views from one session
gets 429 with Retry-After once the session has used its key's requests per minute — `[server]
console_rpm`, or its team's lower `rpm` — while the API with the same key, and other sessions,
go on; the window empties as it ages. A real gateway app on a real socket; its limiter's clock
is frozen and moved by hand, so no outcome depends on how fast the machine is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.keys import new_key
from gateway.accounts.store.base import Team
from gateway.app import STATE, make_app
from gateway.config import parse_config
from gateway.console import LIMIT
from tests.gateway.helpers import ADMIN_KEY

CONSOLE_RPM = 5


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def gateway(tiny_llama: Path, tmp_path: Path) -> AsyncIterator[tuple[TestClient, Clock]]:
    cfg = parse_config(
        {
            "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
            "server": {
                "admin_key_sha256": hashlib.sha256(ADMIN_KEY.encode()).hexdigest(),
                "console_rpm": CONSOLE_RPM,
            },
            "models": {
                "tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}
            },
        }
    )
    app = make_app(cfg)
    clock = Clock()
    async with TestClient(TestServer(app)) as client:
        app[LIMIT].clock = clock
        yield client, clock


async def signed_in(client: TestClient, key: str) -> tuple[aiohttp.ClientSession, str]:
    """A browser of its own (cookie jar) signed in with `key`; its session's CSRF token."""
    browser = aiohttp.ClientSession(
        base_url=client.make_url(""), cookie_jar=aiohttp.CookieJar(unsafe=True)
    )
    form = await (await browser.get("/console/login")).text()
    token = re.search(r'name="csrf" value="([^"]+)"', form)
    assert token, form
    r = await browser.post(
        "/console/login", data={"csrf": token.group(1), "key": key}, allow_redirects=False
    )
    assert r.status == 303, await r.text()
    page = await (await browser.get("/console/batches")).text()
    csrf = re.search(r'name="csrf-token" content="([^"]+)"', page)
    assert csrf, page
    return browser, csrf.group(1)


async def statuses(browser: aiohttp.ClientSession, path: str, n: int) -> list[int]:
    out = []
    for _ in range(n):
        async with browser.get(path, allow_redirects=False) as r:
            out.append(r.status)
    return out


async def test_a_flood_of_page_views_gets_429_and_the_api_goes_on(
    gateway: tuple[TestClient, Clock],
) -> None:
    client, clock = gateway
    state = client.app[STATE]
    admin, csrf = await signed_in(client, ADMIN_KEY)  # its first look (/console/batches) counted
    try:
        assert await statuses(admin, "/console/usage", CONSOLE_RPM - 1) == [200] * (CONSOLE_RPM - 1)
        async with admin.get("/console/usage") as r:
            assert r.status == 429 and r.headers["Retry-After"] == "60"
            assert "Too many requests: this session may make 5 a minute" in await r.text()
        # every console request counts: a form too (it is refused before it acts: still signed in)
        async with admin.post("/console/logout", data={"csrf": csrf}, allow_redirects=False) as r:
            assert r.status == 429
        # the API with the same key is not this window's: it answers
        async with admin.get("/v1/usage", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            assert r.status == 200
        # a team key's session has its own window, held to its team's lower rpm (2 < 5)
        await state.store.create_team(Team(id="t", rpm=2))
        _, secret, _ = key = new_key("t")
        await state.store.create_key(key[0], key[2])
        team, _ = await signed_in(client, secret)  # one look
        try:
            assert await statuses(team, "/console/usage", 2) == [200, 429]
            async with team.get("/v1/usage", headers={"Authorization": f"Bearer {secret}"}) as r:
                assert r.status == 200  # browsing spent none of the team's API requests
        finally:
            await team.close()
        clock.now += 61  # the window has aged: room again
        assert await statuses(admin, "/console/usage", 1) == [200]
    finally:
        await admin.close()


def test_console_rpm_is_checked() -> None:
    from gateway.config import ConfigError

    models = {"m": {"tokenizer": "x", "static": {"both": ["http://127.0.0.1:1"]}}}
    assert parse_config({"models": models}).server.console_rpm == 120
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(ConfigError, match="console_rpm"):
            parse_config({"models": models, "server": {"console_rpm": bad}})
