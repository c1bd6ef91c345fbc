"""The cluster secret: what proves a caller belongs to the cluster on the internal plane (DESIGN
§8).

Nodes, coordinators and gateways share one secret. Every internal HTTP endpoint (a node's legs,
`/kv/*`, `/abort`, `/spans`; a coordinator's `/route`, `/cluster`, drain) requires
`Authorization: Bearer <secret>`; `/health` is the only open path, `/metrics` is open unless
the process runs with `--protect-metrics`. The KV transport's handshake proves the same secret
without sending it (an HMAC over both sides' nonces, kvtransfer/tcp_transport.py).

Why a bearer token and not a per-request HMAC header: it is what DESIGN §8 and vLLM's
`--api-key` use, every client (curl, `duet status`, a Prometheus scrape) can send it, and it
needs no clock agreement between machines nor a hash of streamed or retried bodies. Its one
weakness, the token crossing the network in clear, is what `--tls-cert/--tls-key`
(runtime/plane.py) remove; an HMAC header would only trade it for replay windows.

Where it comes from (`load_secret`): `--cluster-secret-file PATH`, else
`$DUET_CLUSTER_SECRET_FILE`, else `$DUET_CLUSTER_SECRET`. Invariants: a file readable or
writable by group or others is refused (chmod 600); a secret under MIN_SECRET_BYTES bytes, or
with characters a header cannot carry, is refused; a secret that was configured but cannot be
read is an error, never a silent start without one. Comparison is constant-time
(hmac.compare_digest). The secret never appears in a repr or a log line.

`require_secret_policy` is the start-up rule for a process without a secret: bound to loopback
only, it starts with a loud warning (hand-started dev clusters, tests); bound to any other
address it refuses to start unless the operator passed `--insecure`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import stat
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

import msgspec
from aiohttp import web
from aiohttp.typedefs import Middleware

from protocol.openai import APIError
from runtime.log_throttle import ThrottledWarning

log = logging.getLogger("duet.security")

ENV_SECRET = "DUET_CLUSTER_SECRET"
ENV_SECRET_FILE = "DUET_CLUSTER_SECRET_FILE"
#: 256 bits: `secrets.token_urlsafe(32)` gives 43 characters
MIN_SECRET_BYTES = 32
#: the only path every process answers without the secret (load balancers, supervisors)
OPEN_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
_ENC = msgspec.json.Encoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SecretError(ValueError):
    """The configured cluster secret cannot be used (the reason in words, for the operator)."""


class ClusterSecret:
    """One cluster secret. Use `headers` on every internal request, `verify` on every answer."""

    __slots__ = ("_bearer", "_key", "source")

    def __init__(self, value: str, source: str) -> None:
        value = value.strip()
        if len(value.encode()) < MIN_SECRET_BYTES:
            raise SecretError(
                f"the cluster secret from {source} is {len(value.encode())} bytes; it needs at "
                f"least {MIN_SECRET_BYTES} (generate one: python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))')"
            )
        if not value.isascii() or not value.isprintable() or any(c.isspace() for c in value):
            raise SecretError(
                f"the cluster secret from {source} must be printable ASCII without spaces "
                "(it travels in an HTTP header)"
            )
        self._key = value.encode()
        self._bearer = f"Bearer {value}".encode()
        #: where it was read (a path or an environment variable), for messages; never the value
        self.source = source

    def __repr__(self) -> str:
        return f"ClusterSecret(from {self.source})"

    @property
    def headers(self) -> dict[str, str]:
        """The header every internal request carries."""
        return {"Authorization": self._bearer.decode()}

    def verify(self, authorization: str | None) -> bool:
        """Whether an `Authorization` header value carries this secret (constant time)."""
        if not authorization:
            return False
        return hmac.compare_digest(authorization.encode(errors="replace"), self._bearer)

    @property
    def key(self) -> bytes:
        """The HMAC key of handshakes that prove the secret without sending it."""
        return self._key


def hmac_parts(key: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 over `parts`, each length-prefixed so no two splits of the same bytes collide."""
    h = hmac.new(key, digestmod=hashlib.sha256)
    for p in parts:
        h.update(len(p).to_bytes(4, "little"))
        h.update(p)
    return h.digest()


def read_secret_file(path: str | Path) -> ClusterSecret:
    """The secret in `path`: it must be a regular file only its owner can read."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise SecretError(f"cannot read the cluster secret file {str(p)!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecretError(f"the cluster secret file {str(p)!r} is not a regular file")
    if st.st_mode & 0o077:
        raise SecretError(
            f"the cluster secret file {str(p)!r} is accessible by group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 600 {p}"
        )
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise SecretError(f"cannot read the cluster secret file {str(p)!r}: {e}") from None
    return ClusterSecret(text, str(p))


def load_secret(
    file: str | None = None, env: Mapping[str, str] | None = None
) -> ClusterSecret | None:
    """The configured secret (`file`, else $DUET_CLUSTER_SECRET_FILE, else $DUET_CLUSTER_SECRET),
    or None when none is configured. Raises SecretError for one that is configured but unusable."""
    env = os.environ if env is None else env
    path = file or env.get(ENV_SECRET_FILE)
    if path:
        return read_secret_file(path)
    value = env.get(ENV_SECRET)
    if value is not None:
        return ClusterSecret(value, f"${ENV_SECRET}")
    return None


def write_secret_file(path: Path, value: str) -> None:
    """Write `value` to `path`, created 0600 (never readable by others, not even for a moment)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (value + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def is_loopback(host: str) -> bool:
    """Whether listening on `host` reaches this machine only (an empty or wildcard host does
    not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_secret_policy(
    secret: ClusterSecret | None, hosts: Iterable[str], insecure: bool, what: str
) -> None:
    """The start-up rule without a secret: loopback → a loud warning; else SecretError unless
    `insecure` (the operator's explicit choice, warned about too)."""
    if secret is not None:
        return
    hosts = list(hosts)
    exposed = [h for h in hosts if not is_loopback(h)]
    if exposed and not insecure:
        raise SecretError(
            f"{what} listens on {', '.join(exposed)} without a cluster secret: anyone who reaches "
            f"that address could use its internal API. Set --cluster-secret-file (or "
            f"${ENV_SECRET_FILE} / ${ENV_SECRET}), or pass --insecure to run unauthenticated "
            "on purpose"
        )
    banner = "!" * 78
    log.warning(
        "%s\n%s runs WITHOUT a cluster secret on %s: its internal API (completion legs, /kv/*, "
        "/route, drain) is open to any process that reaches it. Fine for a dev cluster on one "
        "machine; set --cluster-secret-file (duet up does) for anything else.\n%s",
        banner,
        what,
        ", ".join(hosts),
        banner,
    )


def _unauthorized(request: web.Request) -> web.Response:
    err = APIError(
        401,
        "this is an internal endpoint of a duet cluster: send the cluster secret as "
        "'Authorization: Bearer <secret>'",
        type_="authentication_error",
        code="cluster_secret_required",
    )
    headers = {"WWW-Authenticate": 'Bearer realm="duet-cluster"'}
    if rid := request.headers.get("X-Request-Id"):
        headers["X-Request-Id"] = rid[:200]
    return web.Response(
        status=401, body=_ENC.encode(err.body()), content_type="application/json", headers=headers
    )


def auth_middleware(
    secret: ClusterSecret,
    *,
    protect_metrics: bool = False,
    extra_check: Callable[[web.Request], bool] | None = None,
) -> Middleware:
    """The middleware of an internal app: 401 before any handler runs (nothing read, nothing
    done) unless the request carries `secret`, or its path is open. `extra_check` may accept a
    request another way (the gateway's admin key on /metrics)."""
    refused = ThrottledWarning(log)  # anyone who reaches the port can cause these

    @web.middleware
    async def cluster_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or (path == METRICS_PATH and not protect_metrics):
            return await handler(request)
        if secret.verify(request.headers.get("Authorization")):
            return await handler(request)
        if extra_check is not None and extra_check(request):
            return await handler(request)
        refused.warning(
            "refused %s %r from %s: no valid cluster secret",
            request.method,
            path[:200],
            request.remote,
        )
        return _unauthorized(request)

    return cluster_auth


def metrics_middleware(check: Callable[[web.Request], bool]) -> Middleware:
    """For a public app (the gateway) whose only internal path is /metrics (`--protect-metrics`):
    401 on /metrics unless `check` accepts the request."""

    @web.middleware
    async def metrics_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == METRICS_PATH and not check(request):
            return _unauthorized(request)
        return await handler(request)

    return metrics_auth
