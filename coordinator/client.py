"""`RouteClient`: the one client of the coordinator's `POST /route`, used by the gateway (through
gateway/backends/routing.py::CoordinatorRouter) and by tools and tests.

Every replica holds a warm index, so any of them may answer. The client starts with the replica
that answered last and moves to the next one when a replica is not an answer (`verdict`):

- 200: the placement (`RouteResponse`);
- a final error: any 4xx (the request is wrong on every replica) or 503 `no_capacity` (the
  cluster is full): `RouteError`, an APIError with the replica's status, OpenAI error body and
  `Retry-After` (seconds, `retry_after_s`). Never retried elsewhere;
- anything else — a connection error, a timeout, another 5xx, an unreadable 200 — moves on.
When no replica answers, `CoordinatorUnavailable` says why for each one.

The replica list may be fixed or a callable read at every request (the gateway adds the replicas
it finds in etcd while it runs). The caller owns the aiohttp session (one per process).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence

import aiohttp
import msgspec

from coordinator.cluster_view import ClusterView
from coordinator.store import Store
from protocol.openai import APIError, parse_error
from protocol.route import RouteRequest, RouteResponse

log = logging.getLogger("duet.coordinator.client")
#: the code of a 503 that is the cluster's answer (every eligible node full), not a sick replica
NO_CAPACITY = "no_capacity"


class Verdict(enum.Enum):
    """What one replica's HTTP status means for the request."""

    ANSWER = "answer"
    FINAL_ERROR = "final_error"
    TRY_NEXT = "try_next"


def verdict(status: int, code: str | None) -> Verdict:
    """The one rule for what is a final answer from a coordinator replica."""
    if status == 200:
        return Verdict.ANSWER
    if 400 <= status < 500 or (status == 503 and code == NO_CAPACITY):
        return Verdict.FINAL_ERROR
    return Verdict.TRY_NEXT


class RouteError(APIError):
    """A replica's final error answer (a 4xx, or 503 no_capacity), as its status and body."""

    def __init__(self, err: APIError, retry_after_s: float | None = None) -> None:
        super().__init__(
            err.status,
            err.message,
            type_=err.type,
            param=err.param,
            code=err.code,
            retry_after_s=retry_after_s,
        )


class CoordinatorUnavailable(Exception):
    """No replica could be reached (each one's failure is in the message)."""


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value else None
    except ValueError:  # an HTTP date: the coordinator never sends one, and 1 s is its own hint
        return 1.0


class RouteClient:
    def __init__(
        self,
        urls: Sequence[str] | Callable[[], Sequence[str]],
        session: aiohttp.ClientSession,
        timeout: float = 2.0,
        auth: dict[str, str] | None = None,
    ) -> None:
        if not callable(urls) and not urls:
            raise ValueError("RouteClient needs at least one coordinator URL")
        fixed = None if callable(urls) else [u.rstrip("/") for u in urls]
        self._urls: Callable[[], Sequence[str]] = urls if fixed is None else (lambda: fixed)  # type: ignore[assignment]
        self.session = session
        #: the cluster secret's header (runtime/plane.py): on every request, the session's or not
        self._auth = dict(auth or {})
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(timeout, 1.0))
        #: the replica that answered last goes first next time
        self._preferred: str | None = None
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(RouteResponse)

    @property
    def urls(self) -> list[str]:
        return [u.rstrip("/") for u in self._urls()]

    def _order(self) -> list[str]:
        urls = self.urls
        if self._preferred in urls:
            k = urls.index(self._preferred)
            urls = urls[k:] + urls[:k]
        return urls

    async def route(self, req: RouteRequest) -> RouteResponse:
        urls = self._order()
        if not urls:
            raise CoordinatorUnavailable("no coordinator replica is known")
        body = self._encoder.encode(req)
        headers = {"Content-Type": "application/json", **self._auth}
        if req.request_id:
            headers["X-Request-Id"] = req.request_id
        failures: list[str] = []
        for url in urls:
            try:
                async with self.session.post(
                    url + "/route", data=body, timeout=self.timeout, headers=headers
                ) as r:
                    data = await r.read()
                    if r.status == 200:
                        resp = self._decoder.decode(data)
                        self._preferred = url
                        return resp
                    err = parse_error(r.status, data)
                    if verdict(r.status, err.code) is Verdict.FINAL_ERROR:
                        self._preferred = url
                        raise RouteError(err, _retry_after(r.headers.get("Retry-After")))
                    failures.append(f"{url}: HTTP {r.status}")
            except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError) as e:
                failures.append(f"{url}: {type(e).__name__}: {e}")
            log.warning("coordinator %s failed (%s); trying the next replica", url, failures[-1])
        raise CoordinatorUnavailable("no coordinator replica answered: " + "; ".join(failures))


async def replica_urls(store: Store, cluster: str) -> list[str]:
    """The URLs of the coordinator replicas alive in `cluster` (from etcd), sorted."""
    return await ClusterView(store, cluster).replicas()
