"""The small interface duet needs from its cluster store (etcd), and the etcd URL parser.

Everything in `coordinator/` and `node/registration.py` reaches etcd through `Store`, so the
registry, election and registration logic never see gRPC types. `EtcdStore`
(coordinator/etcd_store.py) is the one real implementation.

Errors: every failure to reach or use the store is a `StoreError` (callers retry with backoff
and say so in their logs); a lease that no longer exists is `keepalive() == 0`, not an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol
from urllib.parse import urlsplit


class StoreError(RuntimeError):
    """The store is unreachable or refused an operation."""


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    #: lease the key is bound to (0: none)
    lease: int = 0
    mod_revision: int = 0


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    #: the new value (put); empty for a delete
    value: bytes = b""
    #: the store revision of this change (0: not known)
    mod_revision: int = 0


class Store(Protocol):
    async def get(self, key: str) -> KeyValue | None: ...

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store revision they were read at."""
        ...

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write `key`; returns the store revision of the write."""
        ...

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        """Put only if `key` does not exist (the election primitive); True if written."""
        ...

    async def replace(self, key: str, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        """Put only if `key` was last modified at `mod_revision` (compare-and-swap)."""
        ...

    async def delete(self, key: str) -> bool: ...

    def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        """Changes under `prefix` from `start_revision` on; raises StoreError when the watch
        breaks (the caller lists again and re-watches)."""
        ...

    async def grant(self, ttl: int) -> int:
        """A new lease of `ttl` seconds; returns its id."""
        ...

    async def keepalive(self, lease: int, timeout: float | None = None) -> int:
        """Refresh `lease`; returns its remaining TTL, 0 if it expired or never existed.
        `timeout`: this call's deadline (default: the store's)."""
        ...

    async def revoke(self, lease: int) -> None: ...

    async def close(self) -> None: ...


def parse_etcd_urls(url: str) -> list[tuple[str, int]]:
    """Every endpoint of `url`: one URL, or several separated by commas (the members of one etcd
    cluster: 'http://10.0.0.2:2379,http://10.0.0.3:2379,http://10.0.0.4:2379')."""
    parts = [u.strip() for u in url.split(",")]
    if not all(parts):
        raise ValueError(f"cannot read etcd URL {url!r}: an empty endpoint between commas")
    return [_parse_one(u) for u in parts]


def parse_etcd_url(url: str) -> tuple[str, int]:
    """'http://10.0.0.2:2379' (https: TLS) or '10.0.0.2:2379' or '10.0.0.2' → (host, port); a
    comma-separated list of members is checked whole and its first endpoint returned."""
    return parse_etcd_urls(url)[0]


def _parse_one(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https", "") or not parts.hostname:
        raise ValueError(
            f"cannot read etcd URL {url!r} (expected http://HOST:PORT or https://HOST:PORT)"
        )
    try:
        port = parts.port or 2379
    except ValueError:
        raise ValueError(f"cannot read the port of etcd URL {url!r}") from None
    return parts.hostname, port
