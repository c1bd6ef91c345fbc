"""`Store` on a real etcd v3 server through `aetcd` (asyncio gRPC client).

aetcd reconnects its channel by itself when etcd comes back; what breaks is the watch stream
and the calls in flight, which surface here as StoreError. Every RPC has a deadline
(`timeout`), so a dead etcd never hangs a caller.

Several members (a comma-separated URL) share one gRPC channel with one connection per member
and round-robin balancing: calls spread over the members that answer, a member that is down or
cut off fails only the calls that went to it (the callers retry, and the next call goes to
another), and its connection is dropped by the keepalive within `keepalive_time +
keepalive_timeout` when the network went silent rather than closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any, Literal

import aetcd

from coordinator.etcd_auth import EtcdAuth
from coordinator.etcd_tls import make_client
from coordinator.store import KeyValue, StoreError, WatchEvent, parse_etcd_urls


def _target(endpoints: list[tuple[str, int]]) -> tuple[str, int]:
    """aetcd dials f"{host}:{port}": one member as itself; several as gRPC's `ipv4:` address
    list (its last port given apart), which needs each member's address, not a name."""
    if len(endpoints) == 1:
        return endpoints[0]
    addrs = [f"{socket.gethostbyname(h)}:{p}" for h, p in endpoints]
    head, _, port = addrs[-1].rpartition(":")
    return "ipv4:" + ",".join([*addrs[:-1], head]), int(port)


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=kv.key.decode(), value=kv.value, lease=kv.lease, mod_revision=kv.mod_revision
    )


class EtcdStore:
    def __init__(self, url: str, timeout: float = 5.0, auth: EtcdAuth | None = None) -> None:
        """`auth`: TLS and user settings (default: this process's, coordinator/etcd_auth.py)."""
        host, port = _target(parse_etcd_urls(url))
        self.url = url
        self.timeout = timeout
        # gRPC's default reconnect backoff grows to 2 minutes; a restarted etcd must be found
        # again within a lease TTL, so retry at least every second.
        options = {
            "grpc.initial_reconnect_backoff_ms": 200,
            "grpc.min_reconnect_backoff_ms": 200,
            "grpc.max_reconnect_backoff_ms": 1000,
            "grpc.keepalive_time_ms": 5000,
            "grpc.keepalive_timeout_ms": 3000,
            "grpc.lb_policy_name": "round_robin",
        }
        self._client = make_client(host, port, url.startswith("https://"), timeout, options, auth)

    async def _call(self, coro: Any, timeout: float | None = None) -> Any:
        try:
            # aetcd's own timeout does not cover every RPC (a lease revoke on a dead etcd waited
            # forever and hung the coordinator's shutdown): bound each call here as well. Not
            # with `wait_for`: on Python 3.11 it loses a cancel that lands in the turn the call
            # completes, and a lease loop cancelled there never stops.
            async with asyncio.timeout(timeout or self.timeout + 1.0):
                return await coro
        except aetcd.ConnectionFailedError as e:
            # gRPC words this by balancing policy ("failed to connect to all addresses", or
            # "connections to all backends failing" with several members): name it once.
            raise StoreError(f"etcd {self.url}: cannot connect: {e}") from e
        except aetcd.ClientError as e:
            raise StoreError(f"etcd {self.url}: {type(e).__name__}: {e}") from e
        except (TimeoutError, OSError) as e:
            raise StoreError(f"etcd {self.url}: {e!r}") from e

    async def get(self, key: str) -> KeyValue | None:
        r = await self._call(self._client.get(key.encode()))
        return None if r is None else _kv(r)

    async def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        r = await self._call(self._client.get_prefix(prefix.encode()))
        return [_kv(kv) for kv in r.kvs], r.header.revision

    async def put(self, key: str, value: bytes, lease: int = 0) -> int:
        r = await self._call(self._client.put(key.encode(), value, lease=lease or None))
        return int(r.header.revision)

    async def create(self, key: str, value: bytes, lease: int = 0) -> bool:
        t = self._client.transactions
        ok, _ = await self._call(
            self._client.transaction(
                compare=[t.create(key.encode()) == 0],
                success=[t.put(key.encode(), value, lease=lease or None)],
                failure=[],
            )
        )
        return bool(ok)

    async def replace(self, key: str, value: bytes, mod_revision: int, lease: int = 0) -> bool:
        t = self._client.transactions
        ok, _ = await self._call(
            self._client.transaction(
                compare=[t.mod(key.encode()) == mod_revision],
                success=[t.put(key.encode(), value, lease=lease or None)],
                failure=[],
            )
        )
        return bool(ok)

    async def delete(self, key: str) -> bool:
        r = await self._call(self._client.delete(key.encode()))
        return bool(r and r.deleted)

    async def watch_prefix(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        watch = await self._call(
            self._client.watch_prefix(prefix.encode(), start_revision=start_revision)
        )
        try:
            it = aiter(watch)
            while True:
                try:
                    ev = await anext(it)
                except StopAsyncIteration:
                    raise StoreError(f"etcd {self.url}: watch on {prefix} ended") from None
                except aetcd.ClientError as e:
                    raise StoreError(f"etcd {self.url}: watch broke: {e}") from e
                except Exception as e:  # the watcher delivers raw gRPC errors too
                    raise StoreError(f"etcd {self.url}: watch broke: {e!r}") from e
                kind: Literal["put", "delete"] = "put" if ev.kind == "PUT" else "delete"
                yield WatchEvent(
                    kind=kind,
                    key=ev.kv.key.decode(),
                    value=ev.kv.value if kind == "put" else b"",
                    mod_revision=int(ev.kv.mod_revision),
                )
        finally:
            # A broken watcher cannot be cancelled; it is gone anyway.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await watch.cancel()

    async def grant(self, ttl: int) -> int:
        lease = await self._call(self._client.lease(ttl))
        return lease.id

    async def keepalive(self, lease: int, timeout: float | None = None) -> int:
        reply = await self._call(self._client.refresh_lease(lease), timeout)
        return 0 if reply is None else int(reply.TTL)

    async def revoke(self, lease: int) -> None:
        await self._call(self._client.revoke_lease(lease))

    async def close(self) -> None:
        # Closing a channel to a dead etcd may fail; nothing is left to free then.
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5.0):
                await self._client.close()
