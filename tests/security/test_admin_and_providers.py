"""The admin key cannot be guessed, and a provider's words never reach a tenant.

- A gateway refuses to start with an admin key shorter than 32 characters (a short one can be
  guessed offline or online); it used to start with any.
- An address that fails the admin key 10 times in a minute is refused (429 + Retry-After)
  before its key is even compared: online guessing runs at 10 a minute, not at line rate. Other
  addresses are not affected.
- A provider's error text (which can name the operator's account, its quota, another tenant's
  request) goes to the gateway's log, not to the tenant: the tenant gets the gateway's own
  words with the status (it got the provider's message verbatim).

Real parts: the gateway process, HTTP from two loopback source addresses, the official openai
client; the provider is the local fake.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import ADMIN_KEY, gateway_proc, make_team, tiny_model, write_config
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import Proc, free_port, running
from tests.providers.fakes import API_KEY, Fault


@pytest.fixture(scope="module")
def env(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, FakeServers]]:
    tmp = tmp_path_factory.mktemp("admin")
    servers = FakeServers({"gpt": "openai"})
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            gw = gateway_proc(
                tmp, {"gpt": external(servers.fakes["gpt"], {"in": 1.0, "out": 2.0}, 2)}
            )
            with running(gw):
                yield gw, servers
    finally:
        servers.close()


def _admin_get(
    port: int, key: str, source: str, path: str = "/admin/teams"
) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30, source_address=(source, 0))
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
        r = conn.getresponse()
        r.read()
        return r.status, dict(r.getheaders())
    finally:
        conn.close()


def test_a_short_admin_key_is_refused_at_start(tiny_llama: Path, tmp_path: Path) -> None:
    port = free_port()
    cfg = write_config(
        tmp_path / "g.toml",
        {"tiny": tiny_model(tiny_llama, both=["http://127.0.0.1:9"])},
        server={"port": port},
        store={"url": f"sqlite://{tmp_path / 'g.db'}"},
    )
    out = subprocess.run(
        [sys.executable, "-m", "duet", "gateway", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "DUET_ADMIN_KEY": "short-admin-key"},
    )
    assert out.returncode == 2 and "at least 32" in out.stderr, (out.returncode, out.stderr[-2000:])


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "DUET_ADMIN_KEY"}


def test_failed_admin_auth_is_rate_limited_per_address(env: tuple[Proc, FakeServers]) -> None:
    gw, _ = env
    for i in range(10):
        assert _admin_get(gw.port, f"guess-{i}", "127.0.0.3")[0] == 401
    status, headers = _admin_get(gw.port, f"guess-{10}", "127.0.0.3")
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert _admin_get(gw.port, ADMIN_KEY, "127.0.0.3")[0] == 429  # not even compared while blocked
    assert _admin_get(gw.port, ADMIN_KEY, "127.0.0.4")[0] == 200  # another address is not affected


def test_provider_error_text_does_not_reach_the_tenant(env: tuple[Proc, FakeServers]) -> None:
    gw, servers = env
    key = make_team(gw.url, "tenant")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    gpt = servers.fakes["gpt"]
    for status in (500, 400, 429):
        servers.loop.call_soon_threadsafe(gpt.faults.append, Fault.http(status))
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(
                model="gpt", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        text = json.dumps(e.value.body)
        assert "injected" not in text, text  # the fake's own words
        assert f"HTTP {status}" in text or "rate limiting" in text, text
    log = gw.log()
    assert "injected 500" in log  # the operator still sees the provider's words


@pytest.mark.parametrize("path", ["/v1/models", "/v1/usage"])
def test_guesses_on_endpoints_any_key_reads_count_too(
    env: tuple[Proc, FakeServers], path: str
) -> None:
    """/v1/models and /v1/usage take the admin key or a team key: a token that is neither counts
    as a failed admin attempt there too. They compared the admin key with no limit, so guessing
    it went on at line rate beside the limited /admin endpoints."""
    gw, _ = env
    source = "127.0.0.5" if path == "/v1/models" else "127.0.0.6"
    for i in range(10):
        assert _admin_get(gw.port, f"guess-{i}", source, path)[0] == 401
    status, headers = _admin_get(gw.port, "guess-10", source, path)
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert _admin_get(gw.port, ADMIN_KEY, source, path)[0] == 429  # not even compared while blocked
    assert _admin_get(gw.port, ADMIN_KEY, "127.0.0.7", path)[0] == 200
    team_key = make_team(gw.url, f"reader{source[-1]}")
    assert _admin_get(gw.port, team_key, "127.0.0.7", path)[0] == 200  # a team key still reads
