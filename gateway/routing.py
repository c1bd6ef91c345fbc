"""Where a request runs: the `Router` interface and its implementations.

- `CoordinatorRouter` asks the coordinator (`POST /route`, protocol.route), trying each
  replica in turn under a short timeout; a 404/503 from a replica is the cluster's answer, a
  connection error or timeout moves on to the next replica.
- `StaticRouter` picks among node URLs listed in gateway.toml (prefill/decode pairs, or
  colocated `both` nodes), least-loaded by this gateway's own in-flight counts. A real mode
  for small deployments (like vLLM's P/D proxy), and the view used when no coordinator answers.
  It picks D first, then only a P whose KV layout hash matches D's (etcd's view knows the
  hashes; a configured list does not and pairs as listed), else prefills on D.
- `FailoverRouter` tries a primary router and, when no coordinator replica answers at all,
  a fallback one — logged and counted (`duet:route_fallback_total`).

Invariant: a router only ever returns node URLs it learned from its operator (config,
coordinator or etcd), never from a client.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable

import aiohttp
import msgspec

from gateway.config import StaticNodes
from protocol.cluster import kv_layouts_match
from protocol.openai import APIError, parse_error
from protocol.route import RouteRequest, RouteResponse, RouteTarget

log = logging.getLogger("duet.gateway.routing")
_ROUTE_DEC = msgspec.json.Decoder(RouteResponse)
_ENC = msgspec.json.Encoder()


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
        """A placement, or APIError (404 unknown model, 503 no capacity), or NoRouterAnswer."""


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
            raise APIError(404, f"no nodes serve model {req.model!r}", code="model_not_found", param="model")
        exclude = set(req.exclude)
        d = self._least(nodes.decode, exclude)
        if d is None:  # no decode node left: a colocated node does both legs
            both = self._least(nodes.both, exclude)
            if both is None:
                raise APIError(503, f"no healthy node is left for model {req.model!r}",
                               type_="service_unavailable", code="no_capacity")  # fmt: skip
            return RouteResponse(prefill=None, decode=RouteTarget(node_id=both, url=both), reason="static: colocated")
        # D first, then only a P whose KV blocks D can read (the coordinator's rule): a P of
        # another layout would prefill for nothing, D refusing its blocks.
        layout = nodes.kv_layouts.get(d)
        matching = tuple(u for u in nodes.prefill if kv_layouts_match(nodes.kv_layouts.get(u), layout))
        p = self._least(matching, exclude)
        if p is not None:
            reason = "static: least-loaded pair"
        elif self._least(nodes.prefill, exclude) is not None:
            reason = f"static: no prefill node with the KV layout of {d} ({layout}), prefill on decode"
        else:
            reason = "static: no prefill node left, prefill on decode"
        prefill = RouteTarget(node_id=p, url=p) if p is not None else None
        return RouteResponse(prefill=prefill, decode=RouteTarget(node_id=d, url=d), reason=reason)


class CoordinatorRouter(Router):
    def __init__(self, session: aiohttp.ClientSession, urls: Callable[[], list[str]], timeout_s: float) -> None:
        self._session = session
        self._urls = urls
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._preferred = 0  # the replica that answered last goes first next time

    async def route(self, req: RouteRequest) -> RouteResponse:
        urls = self._urls()
        if not urls:
            raise NoRouterAnswer("no coordinator replica is known")
        errors = []
        for i in range(len(urls)):
            k = (self._preferred + i) % len(urls)
            url = urls[k].rstrip("/") + "/route"
            try:
                async with self._session.post(url, data=_ENC.encode(req), timeout=self._timeout,
                                              headers=_headers(req)) as r:  # fmt: skip
                    body = await r.read()
                    if r.status == 200:
                        self._preferred = k
                        return _ROUTE_DEC.decode(body)
                    if r.status in (400, 404, 503):
                        self._preferred = k
                        raise _api_error(r.status, body, r.headers.get("Retry-After"))
                    errors.append(f"{url}: HTTP {r.status}")
            except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as e:
                errors.append(f"{url}: {type(e).__name__}: {e}")
        raise NoRouterAnswer("; ".join(errors))


class FailoverRouter(Router):
    def __init__(self, primary: Router, fallback: Router, on_fallback: Callable[[str], None]) -> None:
        self.primary = primary
        self.fallback = fallback
        self._on_fallback = on_fallback

    async def route(self, req: RouteRequest) -> RouteResponse:
        try:
            return await self.primary.route(req)
        except NoRouterAnswer as e:
            log.warning("no coordinator answered (%s): routing %s from the gateway's own view", e, req.request_id)
            self._on_fallback("no_coordinator")
            return await self.fallback.route(req)


def _headers(req: RouteRequest) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if req.request_id:
        h["X-Request-Id"] = req.request_id
    return h


def _api_error(status: int, body: bytes, retry_after: str | None) -> APIError:
    err = parse_error(status, body)
    if status == 400:  # our request was malformed: the gateway's bug, not the client's
        return APIError(500, f"the coordinator refused the route request: {err.message}", type_="internal_error")
    try:
        retry = float(retry_after) if retry_after is not None else None
    except ValueError:
        retry = None
    return APIError(status, err.message, type_="service_unavailable" if status == 503 else "invalid_request_error",
                    code=err.code or ("no_capacity" if status == 503 else "model_not_found"), retry_after_s=retry)  # fmt: skip
