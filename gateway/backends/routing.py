"""Where a request runs: the `Router` interface and its implementations.

- `CoordinatorRouter` asks the coordinator (`POST /route`, protocol.route) through
  coordinator/client.py's `RouteClient`, the one route client: each replica in turn under a
  short timeout; a 4xx or a 503 no_capacity is the cluster's answer, anything else moves on.
- `StaticRouter` picks among node URLs listed in gateway.toml (prefill/decode pairs, or
  colocated `both` nodes), least-loaded by this gateway's own in-flight counts. A real mode
  for small deployments (like vLLM's P/D proxy), and the view used when no coordinator answers.
  It picks D first, then only a P whose KV layout hash matches D's (etcd's view knows the
  hashes; a configured list does not and pairs as listed), else prefills on D.
- `FailoverRouter` tries a primary router and, when no coordinator replica answers at all,
  a fallback one — logged and counted (`duet:route_fallback_total`).

A model the gateway serves is configured, so "no node serves it" (no registration left: every
node dead, drained or expired) is a capacity outage, not an unknown model: the client gets 503
`no_capacity` with a Retry-After (`outage`), never 404 `model_not_found`, whichever router
found it. A model the gateway does not serve is refused before routing (serving/generate.py).

Invariant: a router only ever returns node URLs it learned from its operator (config,
coordinator or etcd), never from a client.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable

import aiohttp

from coordinator.client import CoordinatorUnavailable, RouteClient, RouteError
from gateway.config import StaticNodes
from protocol.cluster import kv_layouts_match
from protocol.openai import APIError
from protocol.route import RouteRequest, RouteResponse, RouteTarget

log = logging.getLogger("duet.gateway.routing")
#: Retry-After of a capacity outage found by the gateway: about one refresh of etcd's view, in
#: which a restarted node or a new one registers
OUTAGE_RETRY_AFTER_S = 2.0


class NoRouterAnswer(Exception):
    """No replica of the routing service could be reached (not the cluster saying no)."""


class NodeLoad:
    """Requests this gateway has in flight per node URL (the static router's load signal)."""

    def __init__(self) -> None:
        self._n: defaultdict[str, int] = defaultdict(int)

    def acquire(self, url: str) -> None:
        self._n[url] += 1

    def release(self, url: str) -> None:
        self._n[url] -= 1
        if self._n[url] <= 0:
            del self._n[url]

    def __getitem__(self, url: str) -> int:
        return self._n.get(url, 0)


class Router(ABC):
    @abstractmethod
    async def route(self, req: RouteRequest) -> RouteResponse:
        """A placement, or APIError (503 no capacity), or NoRouterAnswer."""


class StaticRouter(Router):
    def __init__(self, pools: Callable[[str], StaticNodes | None], load: NodeLoad) -> None:
        #: model name → its nodes (a callable so an etcd-fed view can change underneath)
        self._pools = pools
        self._load = load

    def _least(self, urls: tuple[str, ...], exclude: set[str]) -> str | None:
        ok = [u for u in urls if u not in exclude]
        return min(ok, key=lambda u: self._load[u]) if ok else None

    async def route(self, req: RouteRequest) -> RouteResponse:
        nodes = self._pools(req.model)
        if nodes is None:
            raise outage(f"no node serves model {req.model!r} now")
        exclude = set(req.exclude)
        d = self._least(nodes.decode, exclude)
        if d is None:  # no decode node left: a colocated node does both legs
            both = self._least(nodes.both, exclude)
            if both is None:
                raise outage(f"no healthy node is left for model {req.model!r}")
            return RouteResponse(
                prefill=None, decode=RouteTarget(node_id=both, url=both), reason="static: colocated"
            )
        # D first, then only a P whose KV blocks D can read (the coordinator's rule): a P of
        # another layout would prefill for nothing, D refusing its blocks.
        layout = nodes.kv_layouts.get(d)
        matching = tuple(
            u for u in nodes.prefill if kv_layouts_match(nodes.kv_layouts.get(u), layout)
        )
        p = self._least(matching, exclude)
        if p is not None:
            reason = "static: least-loaded pair"
        elif self._least(nodes.prefill, exclude) is not None:
            reason = (
                f"static: no prefill node with the KV layout of {d} ({layout}), prefill on decode"
            )
        else:
            reason = "static: no prefill node left, prefill on decode"
        prefill = RouteTarget(node_id=p, url=p) if p is not None else None
        return RouteResponse(prefill=prefill, decode=RouteTarget(node_id=d, url=d), reason=reason)


class CoordinatorRouter(Router):
    """The coordinator replicas through coordinator/client.py::RouteClient (its rule says which
    answer is final); its errors in the gateway's terms."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        urls: Callable[[], list[str]],
        timeout_s: float,
        auth: dict[str, str] | None = None,
    ) -> None:
        self._client = RouteClient(urls, session, timeout_s, auth)

    async def route(self, req: RouteRequest) -> RouteResponse:
        try:
            return await self._client.route(req)
        except CoordinatorUnavailable as e:
            raise NoRouterAnswer(str(e)) from None
        except RouteError as e:
            raise _api_error(e) from None


class FailoverRouter(Router):
    def __init__(
        self, primary: Router, fallback: Router, on_fallback: Callable[[str], None]
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self._on_fallback = on_fallback

    async def route(self, req: RouteRequest) -> RouteResponse:
        try:
            return await self.primary.route(req)
        except NoRouterAnswer as e:
            log.warning(
                "no coordinator answered (%s): routing %s from the gateway's own view",
                e,
                req.request_id,
            )
            self._on_fallback("no_coordinator")
            return await self.fallback.route(req)


def outage(message: str, retry_after_s: float | None = None) -> APIError:
    """503 `no_capacity`: no node can serve a model the gateway serves, for now."""
    return APIError(
        503,
        message,
        type_="service_unavailable",
        code="no_capacity",
        retry_after_s=retry_after_s if retry_after_s is not None else OUTAGE_RETRY_AFTER_S,
    )


def _api_error(e: RouteError) -> APIError:
    """The cluster's final answer for the client: its 503 as it is, its 404 (no node registered
    for the model) a capacity outage (module docstring); any other 4xx means the gateway asked
    wrongly (its bug, or its cluster secret), not the client."""
    if e.status == 404:
        return outage(e.message, e.retry_after_s)
    if e.status != 503:
        return APIError(
            500, f"the coordinator refused the route request: {e.message}", type_="internal_error"
        )
    return APIError(
        503,
        e.message,
        type_="service_unavailable",
        code=e.code or "no_capacity",
        retry_after_s=e.retry_after_s,
    )
