"""Choosing a backend by name: the only place that knows every backend class.

`make_transport("nixl" | "ucx" | "tcp", engine_id=..., **options)`. "nixl" (the default)
falls back to "tcp" when NIXL cannot be imported or its UCX agent cannot start, logging
exactly one line that says so; in strict mode (`CI=true`, runtime/strict.py) that fallback
raises `FallbackRefused` instead, so CI never passes on tcp while reporting nixl. An explicit
"ucx" without ucxx raises `BackendUnavailable` (asking for it is a choice).
Options a backend does not take are rejected, so a typo in a config does not pass silently.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from kvtransfer.base import Transport
from kvtransfer.errors import BackendUnavailable
from runtime.strict import fallback

log = logging.getLogger(__name__)

BACKENDS = ("nixl", "ucx", "tcp")
DEFAULT_BACKEND = "nixl"


def _backend_class(kind: str) -> type[Transport]:
    # Imported lazily: importing the nixl module must not require NIXL to be installed.
    if kind == "nixl":
        from kvtransfer.nixl_transport import NixlTransport

        return NixlTransport
    if kind == "ucx":
        from kvtransfer.ucx_transport import UcxTransport

        return UcxTransport
    if kind == "tcp":
        from kvtransfer.tcp_transport import TcpTransport

        return TcpTransport
    raise ValueError(f"unknown kv transfer backend {kind!r}; choose one of {', '.join(BACKENDS)}")


def _options_for(cls: type[Transport], options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - _accepted(cls))
    if unknown:
        raise TypeError(f"{cls.backend} backend does not take option(s) {', '.join(unknown)}")
    return options


def make_transport(kind: str = DEFAULT_BACKEND, *, engine_id: str, **options: Any) -> Transport:
    """A transport of backend `kind`; its pool still has to be registered.

    Common options: metrics, timeout, hugepages; nixl: progress_thread, poll_interval,
    inline_max_bytes, ucx_params; ucx: host, port; tcp: host, port, advertise_host, secret.
    nixl also takes tcp's options, for its fallback: a node on nixl that falls back to tcp
    listens where a tcp transport would and requires the cluster secret in its handshake (given
    none, the fallback listened on loopback with an empty key: any local reader got the pool).
    Options of one backend are dropped when the other is built.
    Raises FallbackRefused (strict mode) instead of that fallback.
    """
    cls = _backend_class(kind)
    if kind == "nixl":
        tcp = _backend_class("tcp")
        mine, theirs = _accepted(cls), _accepted(tcp)
        unknown = sorted(set(options) - mine - theirs)
        if unknown:
            raise TypeError(f"nixl backend does not take option(s) {', '.join(unknown)}")
        try:
            return cls(engine_id=engine_id, **{k: v for k, v in options.items() if k in mine})
        except BackendUnavailable as e:
            fallback(log, f"kvtransfer: NIXL unavailable ({e})", "the tcp backend")
            return tcp(engine_id=engine_id, **{k: v for k, v in options.items() if k in theirs})
    return cls(engine_id=engine_id, **_options_for(cls, options))


def _accepted(cls: type[Transport]) -> set[str]:
    return set(inspect.signature(cls.__init__).parameters) - {"self", "engine_id"}


def unavailable_reason(kind: str) -> str | None:
    """Why backend `kind` cannot run in this process (None: it can). Imports its library."""
    _backend_class(kind)  # validates the name
    try:
        if kind == "nixl":
            from kvtransfer.nixl_transport import import_nixl

            import_nixl()
        elif kind == "ucx":
            from kvtransfer.ucx_transport import import_ucxx

            import_ucxx()
    except BackendUnavailable as e:
        return str(e)
    return None


def available_backends() -> list[str]:
    """The backends that can run here, in preference order (tcp always can)."""
    return [kind for kind in BACKENDS if unavailable_reason(kind) is None]
