"""`RouteClient`: how a gateway asks the coordinator replicas for a route.

Every replica holds a warm index, so any of them may answer. The client sticks to the replica
that answered last and fails over to the next one on a connection error, a timeout or a 5xx
that is not an answer. Answers are final and never retried elsewhere: a 4xx (the request is
wrong everywhere) and 503 `no_capacity` (the cluster is full) raise `RouteError` with the
replica's OpenAI-shaped error body. When no replica answers, `CoordinatorUnavailable`.

The caller owns the aiohttp session (one per process).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
import msgspec

from coordinator.store import Store
from protocol.cluster import coordinators_prefix
from protocol.route import RouteRequest, RouteResponse

log = logging.getLogger("duet.coordinator.client")


class RouteError(Exception):
    """A replica answered with an error (4xx, or 503 no_capacity)."""

    def __init__(self, status: int, body: dict[str, Any], retry_after: float | None = None) -> None:
        err = body.get("error") if isinstance(body.get("error"), dict) else {}
        super().__init__(f"{status}: {err.get('message', body)}")
        self.status = status
        self.body = body
        self.code: str | None = err.get("code")
        self.retry_after = retry_after


class CoordinatorUnavailable(Exception):
    """No replica could be reached (each one's failure is in the message)."""


def _error_body(data: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return {"error": {"message": data[:300].decode(errors="replace"), "type": "internal_error",
                          "param": None, "code": None}}  # fmt: skip
    return body if isinstance(body, dict) else {"error": {"message": str(body)[:300]}}


class RouteClient:
    def __init__(self, urls: Sequence[str], session: aiohttp.ClientSession, timeout: float = 2.0) -> None:
        if not urls:
            raise ValueError("RouteClient needs at least one coordinator URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 1.0))
        self._current = 0
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(RouteResponse)

    async def route(self, req: RouteRequest) -> RouteResponse:
        body = self._encoder.encode(req)
        failures: list[str] = []
        n = len(self.urls)
        for k in range(n):
            i = (self._current + k) % n
            url = self.urls[i] + "/route"
            try:
                async with self.session.post(url, data=body, timeout=self.timeout,
                                             headers={"Content-Type": "application/json"}) as r:  # fmt: skip
                    data = await r.read()
                    if r.status == 200:
                        self._current = i
                        return self._decoder.decode(data)
                    err = _error_body(data)
                    code = (err.get("error") or {}).get("code") if isinstance(err.get("error"), dict) else None
                    if r.status < 500 or code == "no_capacity":
                        self._current = i
                        retry = r.headers.get("Retry-After")
                        raise RouteError(r.status, err, float(retry) if retry and retry.isdigit() else None)
                    failures.append(f"{self.urls[i]}: HTTP {r.status}")
            except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as e:
                failures.append(f"{self.urls[i]}: {type(e).__name__}: {e}")
            log.warning("coordinator %s failed (%s); trying the next replica", self.urls[i], failures[-1])
        raise CoordinatorUnavailable("no coordinator replica answered: " + "; ".join(failures))


async def replica_urls(store: Store, cluster: str) -> list[str]:
    """The URLs of the coordinator replicas alive in `cluster` (from etcd), sorted."""
    kvs, _ = await store.get_prefix(coordinators_prefix(cluster))
    return sorted(kv.value.decode() for kv in kvs)
