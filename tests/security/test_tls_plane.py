"""The HTTP plane can run over TLS, with the operator's certificate and key.

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
import json
import re
import secrets
import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import openai
import pytest

from runtime.cluster_secret import ClusterSecret, write_secret_file
from runtime.plane import PlaneSecurity
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
def tls_node(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str, Certs, Path]]:
    tmp = tmp_path_factory.mktemp("tls-plane")
    certs = make_certs(tmp / "certs")
    secret = tmp / "cluster.secret"
    write_secret_file(secret, SECRET)
    node = duet_node(
        "both",
        str(tiny_llama),
        tmp,
        *TINY_NODE_ARGS,
        "--cluster-secret-file",
        str(secret),
        "--tls-cert",
        str(certs.server_cert),
        "--tls-key",
        str(certs.server_key),
    )
    url = f"https://127.0.0.1:{node.port}"
    try:
        wait_for(
            lambda: _https_health(url, certs.ca) or node.proc.poll() is not None,
            timeout=120,
            what="the https node healthy",
        )
        assert node.proc.poll() is None, node.log()[-3000:]
        assert f"ready on {url}" in node.log()
        yield node, url, certs, secret
    finally:
        node.terminate()


@pytest.mark.parametrize("role", ["node", "coordinator"])
def test_a_certificate_without_its_key_stops_the_start(role: str, tmp_path: Path) -> None:
    """A half-configured TLS plane is the operator's error at start (exit 2, both flags named),
    never a server that quietly speaks plain http."""
    import subprocess
    import sys

    certs = make_certs(tmp_path / "certs")
    r = subprocess.run(
        [sys.executable, "-m", "duet", role, "--tls-cert", str(certs.server_cert)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--tls-cert and --tls-key go together" in r.stderr, r.stderr


async def _leg(url: str, model: str, security: PlaneSecurity) -> int:
    body = {"model": model, "prompt": list(range(10, 30)), "max_tokens": 2}
    async with security.client_session() as s, s.post(url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


def test_a_leg_over_https_works_for_a_client_that_trusts_the_ca(
    tiny_llama: Path, tls_node: tuple[Proc, str, Certs, Path]
) -> None:
    _, url, certs, _ = tls_node
    secret = ClusterSecret(SECRET, "test")
    assert (
        asyncio.run(_leg(url, tiny_llama.name, PlaneSecurity(secret=secret, tls_ca=str(certs.ca))))
        == 200
    )
    assert (
        asyncio.run(_leg(url, tiny_llama.name, PlaneSecurity(tls_ca=str(certs.ca)))) == 401
    )  # TLS is not auth
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        asyncio.run(
            _leg(url, tiny_llama.name, PlaneSecurity(secret=secret))
        )  # the system's CAs do not know it
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(url.replace("https://", "http://") + "/health", timeout=5).read()


def test_the_gateway_reaches_an_https_node_with_the_cluster_ca(
    tiny_llama: Path, tmp_path: Path, tls_node: tuple[Proc, str, Certs, Path]
) -> None:
    _, url, certs, secret = tls_node
    model = {
        "kind": "cluster",
        "tokenizer": str(tiny_llama),
        "served_name": tiny_llama.name,
        "static": {"both": [url]},
    }
    g = gateway_proc(
        tmp_path,
        {"tiny": model},
        args=("--cluster-secret-file", str(secret), "--tls-ca", str(certs.ca)),
    )
    with running(g):
        key = make_team(g.url, "tls-team")
        client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
        r = client.completions.create(
            model="tiny", prompt="TLS carries the cluster secret", max_tokens=3, temperature=0
        )
        assert r.usage is not None and r.usage.completion_tokens > 0


def _served_serial(url: str, ca: Path) -> str:
    host, port = url.removeprefix("https://").rsplit(":", 1)
    ctx = ssl.create_default_context(cafile=str(ca))
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        cert = tls.getpeercert()
    assert cert is not None
    return str(cert["serialNumber"]).upper()


def test_a_renewed_certificate_is_served_without_a_restart(
    tls_node: tuple[Proc, str, Certs, Path],
) -> None:
    """cert-manager renews a certificate before it expires and the kubelet rewrites the Secret's
    files; the node loaded them once at start, so it served the old one until it expired. Now a
    renewal on disk reaches new connections within seconds, the process never restarted."""
    from tests.security.certs import renew_server

    node, url, certs, _ = tls_node
    before = _served_serial(url, certs.ca)
    serial = renew_server(certs)
    assert serial != before
    wait_for(
        lambda: _served_serial(url, certs.ca) == serial or node.proc.poll() is not None,
        timeout=30,
        what="the renewed certificate served",
    )
    assert node.proc.poll() is None and "loaded the renewed --tls-cert" in node.log()


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


def test_a_whole_cluster_runs_over_https(tiny_llama: Path, tmp_path: Path) -> None:
    """Every process of a P/D cluster serves https (the coordinator included) and trusts the
    cluster's CA: nodes register https URLs in etcd, the coordinator reaches them for /kv/events,
    the gateway routes through the coordinator, the decode node fetches the prefill node's
    /kv/metadata and releases its blocks over https (and reads the KV over the tcp transport,
    whose handshake proves the secret). Plain http reaches none of them.

    The certificate names a host only (DNS:localhost, no IP address), as cert-manager issues
    them on Kubernetes (deploy/components/internal-tls), and every process goes by that name.
    The decode node connects to the address it checked the prefill node's name resolves to, and
    checked the certificate against that address: no pull ever succeeded (502 under
    --failure-policy fail)."""
    from tests.coordinator.conftest import http as plain_http
    from tests.procs import secured_plane

    certs = make_certs(tmp_path / "certs", server_names="DNS:localhost")
    tls = (
        "--tls-cert",
        str(certs.server_cert),
        "--tls-key",
        str(certs.server_key),
        "--tls-ca",
        str(certs.ca),
    )
    node_args = (*TINY_NODE_ARGS, "--transport", "tcp", "--advertise-host", "localhost", *tls)
    security = PlaneSecurity(secret=ClusterSecret(SECRET, "test"), tls_ca=str(certs.ca))

    async def get(url: str) -> tuple[int, str]:
        async with security.client_session() as s, s.get(url) as r:
            return r.status, await r.text()

    with secured_plane(tmp_path, SECRET, "--local-prefill-tokens", "8", *tls) as sp:
        coord = sp.coordinator
        p = sp.node("prefill", tiny_llama, *node_args, node_id="prefill-0")
        d = sp.node(
            "decode", tiny_llama, *node_args, "--failure-policy", "fail", node_id="decode-0"
        )
        urls = {proc: f"https://localhost:{proc.port}" for proc in (coord, p, d)}
        model = {"kind": "cluster", "tokenizer": str(tiny_llama), "served_name": tiny_llama.name}
        g = gateway_proc(
            sp.tmp,
            {"tiny": model},
            routing={"coordinator": [urls[coord]]},
            args=(*sp.flag, "--tls-ca", str(certs.ca)),
        )
        try:
            for proc, url in urls.items():
                wait_for(
                    lambda u=url, q=proc: _https_health(u, certs.ca) or q.proc.poll() is not None,
                    timeout=180,
                    what=f"{url} healthy over https",
                )
                assert proc.proc.poll() is None, proc.log()[-3000:]
            g.wait_healthy(180)

            def ready() -> bool:
                status, text = asyncio.run(get(urls[coord] + "/cluster"))
                if status != 200:
                    return False
                nodes = {n["node_id"]: n for n in json.loads(text)["nodes"]}
                return all(nodes.get(n, {}).get("ready") for n in ("prefill-0", "decode-0"))

            wait_for(ready, timeout=90, what="both nodes ready, seen by the https coordinator")
            status, text = asyncio.run(get(urls[coord] + "/cluster"))
            assert {n["url"] for n in json.loads(text)["nodes"]} == {
                urls[p],
                urls[d],
            }  # https registrations
            key = make_team(g.url, "tls-cluster")
            client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
            r = client.completions.create(
                model="tiny", prompt="every hop over TLS " * 4, max_tokens=4, temperature=0
            )
            assert r.usage is not None and r.usage.completion_tokens > 0
            status, text = asyncio.run(get(urls[d] + "/metrics"))
            moved = sum(
                float(v)
                for v in re.findall(
                    r"^duet:kv_transfer_bytes_total(?:\{[^}]*\})? (\S+)$", text, re.M
                )
            )
            assert (
                status == 200 and moved > 0
            )  # the decode node pulled P's KV (its failure policy: fail)
            for url in urls.values():
                with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
                    plain_http("GET", url.replace("https://", "http://") + "/health")
        finally:
            for proc in (g, d, p, coord):
                proc.terminate()


def test_the_manifests_prestop_hook_drains_an_https_node(
    tls_node: tuple[Proc, str, Certs, Path], tmp_path: Path
) -> None:
    """deploy/'s preStop hook (prefill and decode pods) called http://127.0.0.1:PORT/drain,
    which an https node does not answer: every scale-in fell back to `duet drain` and the
    node's own grace period. With components/internal-tls it goes over https and checks the
    certificate against $DUET_TLS_CA; the hook's own code, as rendered, run against an https
    node. (After the planner's test: the node is drained already, the call answers at once.)"""
    import os
    import shlex
    import subprocess
    import sys

    from tests.deploy.test_manifests import DEPLOY, _container, _env, _one, _render

    _, url, certs, secret = tls_node
    port = url.rsplit(":", 1)[1]
    prefill = _one(_render(DEPLOY / "overlays" / "cpu"), "Deployment", "duet-prefill")
    assert _env(prefill)["DUET_TLS_CA"]["value"]
    hook = _container(prefill)["lifecycle"]["preStop"]["exec"]["command"][2]
    code = shlex.split(hook)[2]  # python -c '<this>' || exec duet drain ...
    code = code.replace("127.0.0.1:8100/", f"127.0.0.1:{port}/").replace("wait=100", "wait=5")
    env = {**os.environ, "DUET_CLUSTER_SECRET_FILE": str(secret)}
    env.pop("DUET_TLS_CA", None)

    def hook_rc(**extra: str) -> int:
        r = subprocess.run(
            [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, timeout=60
        )
        return r.returncode

    assert hook_rc() != 0  # plain http to an https port: the base's hook alone
    other_ca = make_certs(tmp_path / "other").ca
    assert hook_rc(DUET_TLS_CA=str(other_ca)) != 0  # a CA that did not sign its certificate
    assert hook_rc(DUET_TLS_CA=str(certs.ca)) == 0
