"""The guard on failed admin authentications locks out the guesser, not the console, not the
loopback CLI and not valid team keys.

- Bad console sign-ins count against the signing-in client's address only: the console's own
  probes of the API (from the gateway's own socket, 127.0.0.1) used to count too, so ten bad
  sign-ins a minute from anywhere locked every console session and every loopback admin call
  out (429) for a minute, repeatably.
- On endpoints that take the admin key or a team key (`/v1/models`, `/v1/usage`) a valid team
  key is looked up before the guard is consulted, and only admin-shaped failures (tokens that
  cannot be team keys) count: junk tokens from an address shared by many clients (a load
  balancer) made the valid team keys behind it get 429.
- A flood of random bearer tokens from one address is refused (429) before its keys reach the
  store, once the address has failed 50 lookups in 10 s; keys found lately still work.
- Behind a proxy named in `[server] trusted_proxies` the guard counts the client address the
  proxy puts in X-Forwarded-For; an untrusted peer's X-Forwarded-For is ignored.

Real parts: gateway processes, HTTP from several loopback source addresses, the console's
sign-in form with its CSRF double-submit cookie.
"""

from __future__ import annotations

import http.client
import json
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.config import ConfigError, parse_config
from tests.gateway.helpers import ADMIN_KEY, gateway_proc, make_team, tiny_model
from tests.procs import Proc, running

PROXY = "127.0.0.20"


def _gateway(tmp: Path, tiny_llama: Path, **server: object) -> Proc:
    return gateway_proc(
        tmp, {"tiny": tiny_model(tiny_llama, both=["http://127.0.0.1:9"])}, server=server
    )


@pytest.fixture(scope="module")
def gw(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    # found keys stay cached past any pause of a loaded machine
    g = _gateway(tmp_path_factory.mktemp("lockout"), tiny_llama, key_cache_ttl_s=600)
    with running(g):
        yield g


@pytest.fixture(scope="module")
def proxied(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tmp = tmp_path_factory.mktemp("proxied")
    g = _gateway(tmp, tiny_llama, trusted_proxies=[PROXY])
    with running(g):
        yield g


def _get(
    port: int,
    key: str,
    source: str,
    path: str = "/admin/teams",
    xff: str | None = None,
    body: dict[str, object] | None = None,
) -> tuple[int, dict[str, str]]:
    """GET `path` (POST with `body`) with `key`, from the local address `source`."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if xff is not None:
        headers["X-Forwarded-For"] = xff
    try:
        data = None if body is None else json.dumps(body)
        conn.request("GET" if body is None else "POST", path, body=data, headers=headers)
        r = conn.getresponse()
        r.read()
        return r.status, dict(r.getheaders())
    finally:
        conn.close()


def _browser(gw: Proc, source: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        base_url=gw.url,
        cookie_jar=aiohttp.CookieJar(unsafe=True),
        connector=aiohttp.TCPConnector(local_addr=(source, 0)),
    )


async def _sign_in(browser: aiohttp.ClientSession, key: str) -> int:
    form = await (await browser.get("/console/login")).text()
    token = re.search(r'name="csrf" value="([^"]+)"', form)
    assert token, form
    r = await browser.post(
        "/console/login", data={"csrf": token.group(1), "key": key}, allow_redirects=False
    )
    return r.status


async def test_bad_sign_ins_lock_out_only_their_sender(gw: Proc) -> None:
    async with _browser(gw, "127.0.0.8") as admin, _browser(gw, "127.0.0.9") as attacker:
        assert await _sign_in(admin, ADMIN_KEY) == 303
        statuses = [await _sign_in(attacker, f"wrong-admin-guess-{i}") for i in range(11)]
        assert statuses[:10] == [401] * 10 and statuses[10] == 429, statuses
        # the sender is held: its guesses are not even compared, on the console or the API
        assert _get(gw.port, ADMIN_KEY, "127.0.0.9")[0] == 429
        # the admin's session reads on: the console's probes came from 127.0.0.1 and counted
        async with admin.get("/console/usage", allow_redirects=False) as r:
            assert r.status == 200, (r.status, (await r.text())[-400:])
    async with _browser(gw, "127.0.0.14") as other:  # and others sign in
        assert await _sign_in(other, ADMIN_KEY) == 303
    assert _get(gw.port, ADMIN_KEY, "127.0.0.1")[0] == 200  # the loopback CLI too


@pytest.mark.parametrize("junk", ["not-a-key-{}", "sk-duet-junk{}"])
@pytest.mark.parametrize("path", ["/v1/models", "/v1/usage"])
def test_junk_tokens_do_not_lock_out_valid_team_keys(gw: Proc, junk: str, path: str) -> None:
    """A load balancer's address: some clients behind it send junk, another a valid key."""
    source = {
        ("/v1/models", True): "127.0.0.10",
        ("/v1/usage", True): "127.0.0.11",
        ("/v1/models", False): "127.0.0.12",
        ("/v1/usage", False): "127.0.0.13",
    }[path, junk.startswith("not")]
    team_key = make_team(gw.url, f"t{source.rsplit('.', 1)[1]}")
    for i in range(12):
        assert _get(gw.port, junk.format(i), source, path)[0] in (401, 429)
    assert _get(gw.port, team_key, source, path)[0] == 200
    if junk.startswith("not"):  # admin-shaped guesses still end at the guard
        assert _get(gw.port, ADMIN_KEY, source, path)[0] == 429


def test_a_trusted_proxy_names_the_client(proxied: Proc) -> None:
    port = proxied.port
    for i in range(10):
        assert _get(port, f"guess-{i}", PROXY, xff="203.0.113.5")[0] == 401
    assert _get(port, ADMIN_KEY, PROXY, xff="203.0.113.5")[0] == 429
    # another client behind the same proxy, and the proxy's own calls, are not held
    assert _get(port, ADMIN_KEY, PROXY, xff="203.0.113.6")[0] == 200
    assert _get(port, ADMIN_KEY, PROXY)[0] == 200
    # a peer that is no trusted proxy cannot pick the address it is counted under
    for i in range(10):
        spoof = f"198.51.100.{i}"
        assert _get(port, f"guess-{i}", "127.0.0.21", xff=spoof)[0] == 401
    assert _get(port, ADMIN_KEY, "127.0.0.21", xff="198.51.100.99")[0] == 429


def test_a_flood_of_bogus_keys_stops_before_the_store(gw: Proc) -> None:
    """Random bearer tokens on an inference endpoint each made one store query (unknown keys
    were never remembered, failed lookups never limited). Past 50 failures in 10 s an address
    gets 429 before its key is looked up; a key this gateway found lately still works there,
    and other addresses are not held."""
    source = "127.0.0.15"
    team_key = make_team(gw.url, "flooded")
    assert _get(gw.port, team_key, source, "/v1/models")[0] == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    statuses, headers = [], {}
    for _ in range(55):
        status, headers = _get(
            gw.port,
            f"sk-duet-{secrets.token_urlsafe(32)}",
            source,
            "/v1/chat/completions",
            body=chat,
        )
        statuses.append(status)
    assert statuses[:50] == [401] * 50 and set(statuses[50:]) == {429}, statuses
    assert int(headers["Retry-After"]) >= 1
    assert _get(gw.port, team_key, source, "/v1/models")[0] == 200
    other = make_team(gw.url, "bystander")
    assert _get(gw.port, other, "127.0.0.16", "/v1/models")[0] == 200


def test_a_trusted_proxy_that_is_no_address_is_refused_at_start(tiny_llama: Path) -> None:
    models = {"tiny": {"tokenizer": str(tiny_llama), "static": {"both": ["http://127.0.0.1:9"]}}}
    with pytest.raises(ConfigError, match="trusted_proxies: not an address or network: 'lb'"):
        parse_config({"models": models, "server": {"trusted_proxies": ["10.0.0.0/8", "lb"]}})
    cfg = parse_config({"models": models, "server": {"trusted_proxies": ["10.0.0.0/8", "::1"]}})
    assert cfg.server.trusted_proxies == ("10.0.0.0/8", "::1")
