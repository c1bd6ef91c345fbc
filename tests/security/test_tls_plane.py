"""The HTTP plane can run over TLS (issue #22: "optional TLS for the HTTP plane, with
operator-provided cert and key").

A bearer token over plain HTTP crosses the network in clear; across machines the nodes,
coordinators and gateways serve https (`--tls-cert/--tls-key`) and their clients trust the
cluster's CA (`--tls-ca`). Here a node serves https with a certificate signed by a test CA: a
gateway that trusts the CA runs a request through it, a client that does not trust the CA is
refused in the TLS handshake, and plain http to the port gets no answer.

Real parts: a node (tiny model) and a gateway as processes, certificates from the openssl CLI,
the official openai client.
"""

from __future__ import annotations

import asyncio
import secrets
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from protocol.cluster_secret import ClusterSecret, write_secret_file
from protocol.plane import PlaneSecurity
from tests.gateway.helpers import gateway_proc, make_team
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running
from tests.security.certs import Certs, make_certs
from tests.wait import wait_for

SECRET = secrets.token_urlsafe(32)


def _https_health(url: str, ca: Path) -> bool:
    try:
        ctx = ssl.create_default_context(cafile=str(ca))
        with urllib.request.urlopen(url + "/health", timeout=2, context=ctx) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def tls_node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str, Certs, Path]]:
    tmp = tmp_path_factory.mktemp("tls-plane")
    certs = make_certs(tmp / "certs")
    secret = tmp / "cluster.secret"
    write_secret_file(secret, SECRET)
    node = duet_node("both", str(tiny_llama), tmp, *TINY_NODE_ARGS, "--cluster-secret-file", str(secret),
                     "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key))  # fmt: skip
    url = f"https://127.0.0.1:{node.port}"
    try:
        wait_for(lambda: _https_health(url, certs.ca) or node.proc.poll() is not None, timeout=120,
                 what="the https node healthy")  # fmt: skip
        assert node.proc.poll() is None, node.log()[-3000:]
        assert f"ready on {url}" in node.log()
        yield node, url, certs, secret
    finally:
        node.terminate()


async def _leg(url: str, model: str, security: PlaneSecurity) -> int:
    body = {"model": model, "prompt": list(range(10, 30)), "max_tokens": 2}
    async with security.client_session() as s, s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


def test_a_leg_over_https_works_for_a_client_that_trusts_the_ca(tiny_llama: Path,
                                                                tls_node: tuple[Proc, str, Certs, Path]) -> None:  # fmt: skip
    _, url, certs, _ = tls_node
    secret = ClusterSecret(SECRET, "test")
    assert asyncio.run(_leg(url, tiny_llama.name, PlaneSecurity(secret=secret, tls_ca=str(certs.ca)))) == 200
    assert asyncio.run(_leg(url, tiny_llama.name, PlaneSecurity(tls_ca=str(certs.ca)))) == 401  # TLS is not auth
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(_leg(url, tiny_llama.name, PlaneSecurity(secret=secret)))  # the system's CAs do not know it
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(url.replace("https://", "http://") + "/health", timeout=5).read()


def test_the_gateway_reaches_an_https_node_with_the_cluster_ca(tiny_llama: Path, tmp_path: Path,
                                                               tls_node: tuple[Proc, str, Certs, Path]) -> None:  # fmt: skip
    _, url, certs, secret = tls_node
    model = {"kind": "cluster", "tokenizer": str(tiny_llama), "served_name": tiny_llama.name,
             "static": {"both": [url]}}  # fmt: skip
    g = gateway_proc(tmp_path, {"tiny": model}, args=("--cluster-secret-file", str(secret), "--tls-ca", str(certs.ca)))
    with running(g):
        key = make_team(g.url, "tls-team")
        client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        r = client.completions.create(model="tiny", prompt="TLS carries the cluster secret", max_tokens=3,
                                      temperature=0)  # fmt: skip
        assert r.usage is not None and r.usage.completion_tokens > 0


def test_the_planners_drain_reaches_an_https_node(tls_node: tuple[Proc, str, Certs, Path]) -> None:
    """The planner drains a node through the coordinator's own plane session (planner/cli.py):
    the cluster secret and the cluster's CA. It used a bare session, which an https node with a
    private CA refuses in the handshake, so no scale-in could ever drain on a TLS cluster.
    (Last in this module: the node stays drained.)"""
    from planner.drain import Drainer

    _, url, certs, _ = tls_node
    security = PlaneSecurity(secret=ClusterSecret(SECRET, "test"), tls_ca=str(certs.ca))

    async def drain(session_of: PlaneSecurity | None) -> bool:
        session = session_of.client_session() if session_of is not None else aiohttp.ClientSession()
        async with session:
            return (await Drainer(session, poll_s=0.1, deadline_s=30).drain(url)).drained

    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(drain(None))  # what the planner's bare session got
    assert asyncio.run(drain(security)) is True
