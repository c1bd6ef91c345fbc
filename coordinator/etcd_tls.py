"""aetcd clients with this process's etcd TLS and auth settings (coordinator/etcd_auth.py).

aetcd 1.0 opens only plaintext gRPC channels, so `TlsClient` is aetcd's `Client` whose `connect`
opens the channel with grpc's `ssl_channel_credentials` instead (the same steps as aetcd's own
`connect` otherwise) — the rest (the auth token on every call, watches, leases) is aetcd's own.
Without TLS, `make_client` returns aetcd's plain client, with the user and password if set.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
from aetcd import rpc, watcher
from aetcd.client import _handle_errors

from coordinator.etcd_auth import EtcdAuth


class TlsClient(aetcd.Client):
    """aetcd's client over a TLS channel (aetcd.Client.connect, with a secure channel)."""

    _is_connecting: bool  # aetcd's own, set in its __init__

    def __init__(self, *args: Any, credentials: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    @_handle_errors
    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            async with asyncio.timeout(self._connect_wait_timeout):
                await self._connected.wait()
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(
                target, self._credentials, options=self._options.items()
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def make_client(
    host: str,
    port: int,
    https: bool,
    timeout: float,
    options: dict[str, Any],
    auth: EtcdAuth | None = None,
) -> aetcd.Client:
    """The aetcd client for one etcd endpoint with this process's TLS and auth settings."""
    auth = auth if auth is not None else EtcdAuth.from_env()
    kw: dict[str, Any] = {
        "host": host,
        "port": port,
        "timeout": timeout,
        "options": options,
        "username": auth.user,
        "password": auth.password,
    }
    if auth.tls(https):
        return TlsClient(credentials=auth.credentials(), **kw)
    return aetcd.Client(**kw)
