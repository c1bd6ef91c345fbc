"""A batch's callback URL cannot reach a private host or a service port.

The guard refused private, loopback and link-local addresses, and IPv4-mapped IPv6 ones, but an
IPv6 address that wraps an IPv4 one passed as "global": 6to4 (2002::/16) carries its IPv4 host
in bits 16-48 (2002:7f00:1::1 is 127.0.0.1's), Teredo (2001::/32) carries its client's, NAT64
(64:ff9b::/96) its last 32 bits. And any port was accepted: a callback to a public host's SSH or
SMTP port. Now every wrapped IPv4 address must pass too, and a privileged port other than 80 and
443 is refused (both unless the operator allows private callbacks).

`check_callback_url` is what the gateway runs when a batch is submitted (a 400 naming
callback_url) and again before each delivery; the cases are checked on it directly, since the
point is that nothing is ever contacted (no address here is dialled), and then through a real
`duet gateway` process: a tenant submitting such a callback gets the 400 (nothing is stored or
dialled), and its next batch, without one, is accepted.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.batch.callback import CallbackURLError, check_callback_url
from tests.gateway.helpers import gateway_proc, http, make_team
from tests.gateway.test_providers_e2e import FakeServers, external
from tests.procs import running

WRAPPED_PRIVATE = [
    "http://[2002:7f00:1::1]:8080/hook",  # 6to4 of 127.0.0.1
    "http://[2002:a00:1::1]:8080/hook",  # 6to4 of 10.0.0.1
    "http://[2001:0:4136:e378:8000:63bf:f5ff:fffe]:8080/hook",  # Teredo (client 10.0.0.1)
    "http://[64:ff9b::a00:1]:8080/hook",  # NAT64 of 10.0.0.1
    "http://[::ffff:10.0.0.1]:8080/hook",  # IPv4-mapped (refused before too)
]


@pytest.mark.parametrize("url", WRAPPED_PRIVATE)
async def test_ipv6_wrapping_a_private_ipv4_is_refused(url: str) -> None:
    with pytest.raises(CallbackURLError):
        await check_callback_url(url, allow_private=False)


@pytest.mark.parametrize("port", [22, 25, 111, 445])
async def test_privileged_service_ports_are_refused(port: int) -> None:
    # a 6to4 literal wrapping a public IPv4 address: resolution needs no DNS, and the port is
    # refused before anything else
    with pytest.raises(CallbackURLError, match="port"):
        await check_callback_url(f"http://[2002:808:808::1]:{port}/hook", allow_private=False)


async def test_web_and_unprivileged_ports_on_a_public_literal_pass() -> None:
    for url in ("https://[2002:808:808::1]/hook", "http://[2002:808:808::1]:8443/hook"):
        await check_callback_url(url, allow_private=False)  # checked, never dialled


async def test_the_operator_may_allow_private_callbacks() -> None:
    await check_callback_url("http://[2002:7f00:1::1]:22/hook", allow_private=True)


def test_a_tenant_submitting_a_wrapped_or_service_port_callback_gets_a_400(tmp_path: Path) -> None:
    servers = FakeServers({"gpt": "openai"})
    batch = {"data_dir": str(tmp_path / "batch"), "callback_secret": "cb-secret", "poll_s": 0.05}
    gw = gateway_proc(
        tmp_path, {"gpt": external(servers.fakes["gpt"], {"in": 1.0, "out": 1.0}, 2)}, batch=batch
    )
    line = {"model": "gpt", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        with running(gw):
            key = make_team(gw.url, "t")
            for url in [*WRAPPED_PRIVATE, "http://[2002:808:808::1]:22/hook"]:
                status, _, body = http(
                    f"{gw.url}/v1/batch", "POST", {"requests": [line], "callback_url": url}, key=key
                )
                assert status == 400 and body["error"]["param"] == "callback_url", (
                    url,
                    json.dumps(body),
                )
            # the refusals are the request's only: the same tenant's batch without a callback runs
            status, _, body = http(f"{gw.url}/v1/batch", "POST", {"requests": [line]}, key=key)
            assert status == 202, body
    finally:
        servers.close()
