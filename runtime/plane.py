"""One process's settings for the internal plane: its cluster secret, TLS and metrics policy.

A node, a coordinator and a gateway each hold one `PlaneSecurity` (from the flags of
duet/security_args.py). The server side: `middlewares()` (the cluster-secret check,
runtime/cluster_secret.py), `server_ssl()` (an https listener when `--tls-cert/--tls-key` are
set; `renewals()` loads renewed certificate files into it while the process runs). The client
side: `headers` on every internal request and `client_ssl()`, which trusts `--tls-ca` (plus the
system's CAs) for https peers. `scheme` is what a process writes into a
URL it builds from a bare host and port (a peer named in `kv_transfer_params`, its own
registration): https once the plane runs TLS.

Invariants: on a node or coordinator `--protect-metrics` needs a secret (`check_start`: it would
lock out everyone otherwise; the gateway also takes its admin key there); a TLS
cert needs its key and the reverse; a process without a secret obeys
cluster_secret.require_secret_policy before it listens.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Middleware

from runtime.cluster_secret import (
    ClusterSecret,
    SecretError,
    auth_middleware,
    require_secret_policy,
)

log = logging.getLogger("duet.plane")

#: seconds between two looks at the certificate files for a renewal (a stat each)
RENEWAL_CHECK_S = 5.0


@dataclass(frozen=True)
class PlaneSecurity:
    secret: ClusterSecret | None = None
    #: /metrics needs the secret too (default: open, for a scraper on the private network)
    protect_metrics: bool = False
    #: start without a secret on a non-loopback address (the operator's explicit choice)
    insecure: bool = False
    tls_cert: str | None = None
    tls_key: str | None = None
    #: CA bundle that signs the cluster's certificates (clients trust it, with the system's)
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SecretError("--tls-cert and --tls-key go together")

    @property
    def tls(self) -> bool:
        """Whether this plane speaks https (this process serves it, or trusts a cluster CA)."""
        return bool(self.tls_cert or self.tls_ca)

    @property
    def scheme(self) -> str:
        """For a peer's URL built from a bare host and port (a plane with TLS is TLS throughout)."""
        return "https" if self.tls else "http"

    @property
    def own_scheme(self) -> str:
        """For this process's own URL (what it registers, advertises and prints): what it serves."""
        return "https" if self.tls_cert else "http"

    @property
    def headers(self) -> dict[str, str]:
        return self.secret.headers if self.secret is not None else {}

    def check_start(self, hosts: Iterable[str], what: str) -> None:
        """Refuse (SecretError) or warn about a start without a secret (cluster_secret's rule)."""
        if self.protect_metrics and self.secret is None:
            raise SecretError(
                "--protect-metrics needs a cluster secret (--cluster-secret-file): "
                "without one nothing could read /metrics"
            )
        require_secret_policy(self.secret, hosts, self.insecure, what)

    def middlewares(
        self, extra_check: Callable[[web.Request], bool] | None = None
    ) -> list[Middleware]:
        """The server's auth middleware (outermost), or none without a secret."""
        if self.secret is None:
            return []
        return [
            auth_middleware(
                self.secret, protect_metrics=self.protect_metrics, extra_check=extra_check
            )
        ]

    def server_ssl(self) -> ssl.SSLContext | None:
        if not self.tls_cert:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as e:
            raise SecretError(
                f"cannot load --tls-cert {self.tls_cert!r} / --tls-key: {e}"
            ) from None
        return ctx

    def renewals(self, ctx: ssl.SSLContext | None) -> asyncio.Task[None] | None:
        """Watch --tls-cert/--tls-key and load them into `ctx` (the listener's) when they change:
        new connections get the renewed certificate. cert-manager renews before expiry and the
        kubelet rewrites the mounted files; a process that loaded them once would serve the old
        certificate past its end. None without TLS. (Needs a running event loop; the task ends
        with it.)"""
        if ctx is None or not self.tls_cert or not self.tls_key:
            return None
        return asyncio.ensure_future(_reload_on_change(ctx, self.tls_cert, self.tls_key))

    def client_ssl(self) -> ssl.SSLContext | bool:
        """The client's TLS trust: the system's CAs, plus `tls_ca` when set (True: aiohttp's
        default)."""
        if not self.tls_ca:
            return True
        ctx = ssl.create_default_context()
        try:
            ctx.load_verify_locations(cafile=self.tls_ca)
        except (OSError, ssl.SSLError) as e:
            raise SecretError(f"cannot load --tls-ca {self.tls_ca!r}: {e}") from None
        return ctx

    def client_session(
        self, trace_configs: list[aiohttp.TraceConfig] | None = None
    ) -> aiohttp.ClientSession:
        """A session for the internal plane only: every request carries the secret. (Never for a
        session that also reaches third parties: the gateway adds `headers` per request.)
        `trace_configs`: runtime.tracing's, so the session's requests carry `traceparent`."""
        return aiohttp.ClientSession(
            headers=self.headers,
            trace_configs=trace_configs,
            connector=aiohttp.TCPConnector(ssl=self.client_ssl()),
        )


async def _reload_on_change(ctx: ssl.SSLContext, cert: str, key: str) -> None:
    def stamp() -> tuple[tuple[int, int, int], ...]:
        # stat follows the kubelet's ..data symlink: a renewal changes the inode
        return tuple(
            (st.st_ino, st.st_mtime_ns, st.st_size) for st in (os.stat(cert), os.stat(key))
        )

    seen = stamp()
    while True:
        await asyncio.sleep(RENEWAL_CHECK_S)
        try:
            now = stamp()
            if now == seen:
                continue
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            # a certificate written before its key (not by the kubelet, whose swap is atomic):
            # the next look finds both
            log.warning(
                "cannot load the renewed --tls-cert %s: %s; still serving the last", cert, e
            )
            continue
        seen = now
        log.info("loaded the renewed --tls-cert %s", cert)
