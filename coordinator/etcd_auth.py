"""How a duet process authenticates to etcd: TLS (server CA, client certificate) and etcd's
user/password auth (docs/security.md, "etcd").

Settings come from the environment, so every `EtcdStore` of a process (node registration and
membership, the coordinator, the gateway's view, `duet drain`, `duet status`) and every child
`duet up` starts use the same ones: `DUET_ETCD_CA`, `DUET_ETCD_CERT`, `DUET_ETCD_KEY`,
`DUET_ETCD_USER`, `DUET_ETCD_PASSWORD` (or `DUET_ETCD_PASSWORD_FILE`). The CLI flags
`--etcd-ca/--etcd-cert/--etcd-key/--etcd-user` set those variables for their process
(`apply_etcd_args`); a password is never a flag (it would show in `ps`). An `https://` etcd URL
turns TLS on (with the system's CAs unless `DUET_ETCD_CA`).

The client that honours them is coordinator/etcd_tls.py (this module imports neither aetcd nor
grpc, so the CLI's parsers stay cheap).

Invariants: a client certificate needs its key; a user needs a password; a file that cannot be
read is a ValueError at start-up, never a plaintext fallback.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV = {
    "ca": "DUET_ETCD_CA",
    "cert": "DUET_ETCD_CERT",
    "key": "DUET_ETCD_KEY",
    "user": "DUET_ETCD_USER",
    "password": "DUET_ETCD_PASSWORD",
    "password_file": "DUET_ETCD_PASSWORD_FILE",
}


@dataclass(frozen=True)
class EtcdAuth:
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError(
                "an etcd client certificate needs its key (--etcd-cert and --etcd-key go together)"
            )
        if bool(self.user) != bool(self.password):
            raise ValueError(
                "an etcd user needs a password ($DUET_ETCD_PASSWORD or $DUET_ETCD_PASSWORD_FILE)"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> EtcdAuth:
        env = os.environ if env is None else env
        password = env.get(ENV["password"]) or None
        if password is None and env.get(ENV["password_file"]):
            try:
                password = Path(env[ENV["password_file"]]).read_text().strip() or None
            except OSError as e:
                raise ValueError(f"cannot read ${ENV['password_file']}: {e}") from None
        return cls(
            ca=env.get(ENV["ca"]) or None,
            cert=env.get(ENV["cert"]) or None,
            key=env.get(ENV["key"]) or None,
            user=env.get(ENV["user"]) or None,
            password=password,
        )

    def tls(self, https: bool) -> bool:
        return https or bool(self.ca or self.cert)

    def credentials(self) -> Any:
        """grpc channel credentials (the CA, the client certificate)."""
        import grpc

        def read(path: str | None, what: str) -> bytes | None:
            if not path:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as e:
                raise ValueError(f"cannot read the etcd {what} {path!r}: {e.strerror}") from None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca, "CA"),
            private_key=read(self.key, "client key"),
            certificate_chain=read(self.cert, "client certificate"),
        )


def add_etcd_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--etcd-ca",
        default=None,
        metavar="PEM",
        help="CA of etcd's certificate (TLS; $DUET_ETCD_CA)",
    )
    p.add_argument(
        "--etcd-cert",
        default=None,
        metavar="PEM",
        help="client certificate for etcd ($DUET_ETCD_CERT)",
    )
    p.add_argument(
        "--etcd-key", default=None, metavar="PEM", help="its private key ($DUET_ETCD_KEY)"
    )
    p.add_argument(
        "--etcd-user",
        default=None,
        metavar="NAME",
        help="etcd user; the password comes from $DUET_ETCD_PASSWORD or $DUET_ETCD_PASSWORD_FILE",
    )


def apply_etcd_args(args: argparse.Namespace) -> None:
    """The flags as this process's settings (its environment, so every store, and every child a
    supervisor starts, uses them); checks them now (ValueError)."""
    for name in ("ca", "cert", "key", "user"):
        value = getattr(args, f"etcd_{name}", None)
        if value:
            os.environ[ENV[name]] = str(value)
    EtcdAuth.from_env()
