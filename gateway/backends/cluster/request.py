"""One request on duet's nodes (`ClusterRequest`, made per `ClusterBackend.open`): the client's
request, its attempt, its reply's accounting and the (node, request id) pairs it reached, with
the steps every decode leg takes — route, prefill on P unless the route says D, start the
decode stream up to its first token (`open_leg`, retried on other nodes up to
`[routing] max_attempts`) — and the reading of sample 0's leg (`follow`).

Failure answers, all under the same X-Request-Id: P fails before the transfer → route again
without P (another P, or prefill locally on D); D fails before its first token → abort what the
try touched (P's held blocks included) and route again without D. A node that could not be
reached at all is also left out of this gateway's later routes for a while (unreachable.py).
What follows a failure after the first token is migration.py's; several samples are fanout.py's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from gateway.accounts.usage import Accounting
from gateway.backends.base import Attempt, Piece, midstream
from gateway.backends.cluster.legs import DecodeLeg, NodeStream, leg_request, route_request
from gateway.backends.cluster.nodes import Nodes, Touch
from gateway.backends.cluster.samples import SampleStream
from gateway.backends.node_client import NodeFailure
from gateway.serving.requests import Request
from protocol.block_hash import block_hashes, domain_root
from protocol.kv_params import KVTransferParams
from protocol.openai import APIError
from protocol.route import RouteResponse
from runtime.tracing import GEN_AI_INPUT_TOKENS, SERVER_ADDRESS, Attrs

log = logging.getLogger("duet.gateway.cluster")


class ClusterRequest:
    def __init__(self, nodes: Nodes, request: Request, attempt: Attempt, acc: Accounting) -> None:
        self.nodes = nodes
        self.request = request
        self.attempt = attempt
        self.acc = acc
        #: (url, request id) pairs this request reached, to abort if it does not complete
        self.touched: set[Touch] = set()
        self.t0 = time.monotonic()

    def first_sample(self) -> SampleStream:
        return SampleStream(t0=self.t0, seed=self.request.sampling.seed)

    async def open_leg(self, s: SampleStream, attempt: Attempt) -> DecodeLeg:
        """Route, prefill on P (unless the route says D), start the decode leg on D up to its
        first token: retried on other nodes up to max_attempts. A migrated leg's `attempt` is
        its own (its id, the prompt plus the streamed ids) and its decode request carries
        `s.resume`."""
        # rooted at the caller's domain and the adapter, as the nodes' blocks are
        root = domain_root(attempt.cache_domain, adapter=attempt.model.adapter)
        hashes = block_hashes(attempt.prompt_ids, attempt.model.block_size, parent=root)
        failures: list[str] = []
        for n in range(self.nodes.cfg.max_attempts):
            if n:
                self.nodes.on_retry("route")
            route = await self._route(attempt, hashes, s.exclude, n)
            tried: list[Touch] = []
            try:
                kv = await self._prefill(route, tried, s, attempt)
                leg = await self._decode(route, kv, tried, s, attempt)
            except NodeFailure as e:
                failures.append(str(e))
                await self.nodes.abort(tried)
                continue
            if route.prefill is not None:
                self.acc.nodes.append(route.prefill.node_id)
            self.acc.nodes.append(leg.node_id)
            s.node_id, s.leg, s.span = leg.node_id, (leg.url, leg.request_id), leg.span
            return leg
        raise APIError(
            503,
            f"the request failed on every node tried ({self.nodes.cfg.max_attempts} attempts): "
            + "; ".join(failures),
            type_="service_unavailable",
            code="upstream_unavailable",
        )

    async def _route(
        self, attempt: Attempt, hashes: list[int], exclude: list[str], n: int
    ) -> RouteResponse:
        """The router's placement, in a span that says where and why, without the nodes this
        gateway could not reach lately — unless that leaves no node: then with them."""
        away = [i for i in self.nodes.unreachable.node_ids() if i not in exclude]
        req = route_request(attempt, hashes, exclude + away)
        attrs: Attrs = {"duet.attempt": n, "duet.exclude": list(req.exclude)}
        with self.nodes.tracing.span("gateway.route", attrs) as span:
            try:
                route = await self.nodes.router.route(req)
            except APIError as e:
                if not away or e.status != 503:
                    raise
                route = await self.nodes.router.route(route_request(attempt, hashes, exclude))
            if span is not None:
                span.set_attributes(_placement(route))
            return route

    async def _prefill(
        self, route: RouteResponse, tried: list[Touch], s: SampleStream, attempt: Attempt
    ) -> KVTransferParams | None:
        """The prefill leg on the route's P, if it names one: P's KV handle for D (a guided
        request's with the first token P sampled, which D continues from)."""
        p, nodes = route.prefill, self.nodes
        if p is None:
            return None
        rid = attempt.request_id
        tried.append((p.url, rid))
        self.touched.add((p.url, rid))
        nodes.load.acquire(p.url)
        attrs: Attrs = {
            "duet.node_id": p.node_id,
            SERVER_ADDRESS: p.url,
            "duet.cached_tokens": p.cached_tokens,
        }
        try:
            with nodes.tracing.span("gateway.prefill_leg", attrs, kind="CLIENT") as span:
                self.acc.prompt_sent = True
                fields = replace(s.prefill_fields(self.request, attempt), kv_source=route.kv_source)
                body = leg_request(self.request, attempt, fields)
                answer = await nodes.client.prefill(p.url, rid, body)
                if span is not None and answer.usage is not None:
                    span.set_attribute(GEN_AI_INPUT_TOKENS, answer.usage.prompt_tokens)
            return answer.kv_transfer_params
        except NodeFailure as e:
            log.warning(
                "%s: prefill on %s failed (%s); routing again without it", rid, p.node_id, e.reason
            )
            s.exclude.append(p.node_id)
            if e.unreachable:
                nodes.unreachable.mark(p.node_id, e.reason)
            raise
        finally:
            nodes.load.release(p.url)

    async def _decode(
        self,
        route: RouteResponse,
        kv: KVTransferParams | None,
        tried: list[Touch],
        s: SampleStream,
        attempt: Attempt,
    ) -> DecodeLeg:
        """The decode leg on the route's D, started up to its first chunk that carries tokens."""
        d, rid, tr = route.decode, attempt.request_id, self.nodes.tracing
        self.touched.add((d.url, rid))
        tried.append((d.url, rid))
        # the node computing the prompt pulls its prefix from the route's KV source
        source = route.kv_source if route.prefill is None else None
        fields = s.decode_fields(self.request, attempt, kv, source)
        body = leg_request(self.request, attempt, fields)
        stream = NodeStream(self.nodes.client, self.nodes.load, d.url, rid, s.index, body)
        attrs: Attrs = {
            "duet.node_id": d.node_id,
            SERVER_ADDRESS: d.url,
            "duet.cached_tokens": d.cached_tokens,
        }
        span = tr.start("gateway.decode_leg", attrs, kind="CLIENT")
        t_start = time.time_ns()
        try:
            self.acc.prompt_sent = True
            with tr.current(span):  # its POST carries this span's traceparent
                head = await stream.start()
        except NodeFailure as e:
            tr.end(span, error=e.reason)
            log.warning(
                "%s: decode on %s failed before its first token (%s); routing again without it",
                rid,
                d.node_id,
                e.reason,
            )
            s.exclude.append(d.node_id)
            if e.unreachable:
                self.nodes.unreachable.mark(d.node_id, e.reason)
            raise
        except BaseException as e:
            tr.end(span, error=type(e).__name__)
            raise
        tr.record("gateway.first_token", t_start, time.time_ns(), parent=span)
        return DecodeLeg(d.node_id, stream, head, span)

    async def follow(self, leg: DecodeLeg, s: SampleStream) -> AsyncIterator[Piece]:
        """Sample 0's pieces from one decode leg. A node failure before its last token ends them
        with `s.failure` set (the caller migrates the stream); any other failure raises
        MidStreamError."""
        it = leg.chunks()
        try:
            async for chunk, more in it:
                pieces = s.pieces(chunk, self.acc)
                for piece in pieces:
                    piece.more = more or piece is not pieces[-1]
                    yield piece
        except NodeFailure as e:
            if not s.finished:  # a node that died after its last token owes nothing
                s.failure = e
        except Exception as e:
            self.nodes.tracing.end(s.span, error=type(e).__name__)
            s.span = None
            raise midstream(e) from None
        finally:
            await it.aclose()  # now, not at GC: frees the node's load count and connection
            s.leg_ended(self.acc, self.nodes.tracing, s.failure.reason if s.failure else None)


def _placement(route: RouteResponse) -> dict[str, str | int]:
    p, d = route.prefill, route.decode
    return {
        "duet.route.reason": route.reason,
        "duet.decode.node_id": d.node_id,
        "duet.prefill.node_id": p.node_id if p is not None else "",
        "duet.cached_tokens": max(d.cached_tokens, p.cached_tokens if p is not None else 0),
    }
