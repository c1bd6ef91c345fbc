"""A throw-away certificate authority for TLS tests, made with the `openssl` CLI (the
`cryptography` package is not a dependency): a CA, a server certificate for 127.0.0.1 and
localhost (or the names given: `server_names`) and a client certificate, each signed by the CA,
every key 0600."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {r.stderr[-2000:]}")


def make_certs(d: Path, server_names: str = "IP:127.0.0.1,DNS:localhost") -> Certs:
    """`server_names`: the server certificate's subjectAltName (the client's is the default)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make test certificates")
    d.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=duet test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )
    default = "IP:127.0.0.1,DNS:localhost"
    for name, usage, sans in (
        ("server", "serverAuth", server_names),
        ("client", "clientAuth", default),
    ):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=duet test {name}",
            cwd=d,
        )
        (d / f"{name}.ext").write_text(
            f"subjectAltName={sans}\nextendedKeyUsage={usage}\nbasicConstraints=CA:FALSE\n"
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
            cwd=d,
        )
    for key in d.glob("*.key"):
        key.chmod(0o600)
    return Certs(
        d / "ca.pem", d / "server.pem", d / "server.key", d / "client.pem", d / "client.key"
    )


def renew_server(certs: Certs) -> str:
    """Sign the server's key again (a new serial, as a renewal has) and swap it into place at
    once, as the kubelet updates a Secret volume; returns the new serial (hex, upper case)."""
    d = certs.server_cert.parent
    _openssl(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAserial",
        "ca.srl",
        "-out",
        "server.renewed.pem",
        "-days",
        "2",
        "-extfile",
        "server.ext",
        cwd=d,
    )
    r = subprocess.run(
        ["openssl", "x509", "-noout", "-serial", "-in", "server.renewed.pem"],
        cwd=d,
        capture_output=True,
        text=True,
        check=True,
    )
    (d / "server.renewed.pem").replace(certs.server_cert)
    return r.stdout.strip().split("=", 1)[1].upper()
