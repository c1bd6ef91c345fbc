"""`ClusterBackend`: serve a request on duet's own nodes (DESIGN §1 steps 2-5).

route → prefill leg on P (unless the route says "prefill on D") → decode leg on D, streamed.
Each `open` makes one `ClusterRequest` (request.py: the request, its attempt, its accounting,
the nodes it touched), whose steps are the legs' (legs.py), its samples' streams (samples.py),
migration when a decode node dies after the first token (migration.py) and, for n > 1, the
fan-out of samples on sample 0's node (fanout.py). The same for a whole (non-streamed)
answer, which reads the same stream.

The request ends any way but complete (error, client gone, cancelled) → `POST /abort` on every
node it touched, in a task the client's cancellation cannot stop.

A versioned model's attempt is pinned to one version (versions.py), and counted in that
version's outcomes (version_outcomes.py: what a rollout judges it by). An attempt that fails on
its version before its first token (every node tried failed, or none could be routed: a 5xx)
runs again, under the same request id, on the version serving the most of the others: the
client gets an answer while a bad version is still taking requests, and the record names the
version that answered.

Usage: the prompt is billed once, with the cached tokens the answering leg of sample 0
reported; each piece carries the completion tokens whose output it delivers (samples.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace

from gateway.accounts.usage import Accounting
from gateway.backends.base import Attempt, Backend, Piece, Reply, Shed
from gateway.backends.cluster.fanout import fan_out
from gateway.backends.cluster.migration import migrate
from gateway.backends.cluster.nodes import Nodes
from gateway.backends.cluster.request import ClusterRequest
from gateway.backends.cluster.versions import Versions, VersionSet
from gateway.backends.node_client import NodeClient
from gateway.backends.providers.fallback import Reason
from gateway.backends.routing import NodeLoad, Router
from gateway.config import RoutingConfig, Tier
from gateway.serving.requests import Endpoint, Request
from protocol.openai import APIError
from runtime.tracing import Tracing

log = logging.getLogger("duet.gateway.cluster")

#: errors that mean "no node can serve this model now" (router and ClusterBackend codes)
_NO_NODES = {(503, "no_capacity"), (503, "upstream_unavailable")}


class ClusterBackend(Backend):
    uses_tier_queues = True

    def __init__(
        self,
        nodes: NodeClient,
        router: Router,
        load: NodeLoad,
        cfg: RoutingConfig,
        on_retry: Callable[[str], None] = lambda _: None,
        tracing: Tracing | None = None,
    ) -> None:
        self.nodes = Nodes(nodes, router, load, cfg, on_retry, tracing or Tracing.off())
        #: a versioned model's split (versions.py): each attempt is pinned to one version
        self.versions = Versions()

    @property
    def load(self) -> NodeLoad:
        return self.nodes.load

    def usable_for(self, endpoint: Endpoint, n: int) -> bool:
        return True

    def fallback_reason(self, err: APIError, tier: Tier) -> Reason | None:
        if isinstance(err, Shed):  # the admission queue: batch requests are there to wait
            return Reason.SATURATED if tier == "interactive" else None
        return Reason.NO_HEALTHY_NODES if (err.status, err.code) in _NO_NODES else None

    def open(self, request: Request, attempt: Attempt) -> Reply:
        if not attempt.model.versions:

            def pieces(acc: Accounting) -> AsyncGenerator[Piece, None]:
                return self._pieces(ClusterRequest(self.nodes, request, attempt, acc))

            return Reply(pieces, prompt_tokens=len(attempt.prompt_ids))
        vs = self.versions.of(attempt.model)
        first = vs.pick()

        def versioned(acc: Accounting) -> AsyncGenerator[Piece, None]:
            return self._versioned(request, attempt, vs, first, acc)

        return Reply(versioned, prompt_tokens=len(attempt.prompt_ids))

    async def drain(self) -> None:
        """Wait for pending aborts (at shutdown)."""
        await self.nodes.drain()

    async def _versioned(
        self, request: Request, attempt: Attempt, vs: VersionSet, i: int, acc: Accounting
    ) -> AsyncGenerator[Piece, None]:
        """The attempt on version `i`; failed there before its first token, on the fallback
        version (module docstring). Each version's try counts in its outcomes."""
        tried = set[int]()
        while True:
            tried.add(i)
            name = acc.version = vs.versions[i].name
            r = ClusterRequest(self.nodes, request, replace(attempt, model=vs.models[i]), acc)
            t0, answered, first_at, later_tokens = time.monotonic(), False, 0.0, 0
            try:
                async for piece in self._pieces(r):
                    if not answered:
                        answered, first_at = True, time.monotonic()
                        vs.outcomes.record(name, True, first_at - t0)
                    else:
                        later_tokens += piece.tokens
                    yield piece
                if later_tokens:  # a whole answer: its inter-token latency
                    vs.outcomes.record_itl(name, (time.monotonic() - first_at) / later_tokens)
                return
            except APIError as e:
                if answered:
                    raise
                vs.outcomes.record(name, False)
                j = vs.fallback(tried) if e.status >= 500 else None  # a 4xx is the request's own
                if j is None:
                    raise
                log.warning(
                    "%s: failed on version %s (%s); trying version %s",
                    attempt.request_id,
                    name,
                    e.message,
                    vs.versions[j].name,
                )
                i = j

    async def _pieces(self, r: ClusterRequest) -> AsyncGenerator[Piece, None]:
        complete = False
        try:
            async for piece in _run(r):
                yield piece
            complete = True
        finally:
            if not complete and r.touched:
                self.nodes.abort_later(r.touched)


async def _run(r: ClusterRequest) -> AsyncIterator[Piece]:
    """Sample 0 on its first leg, migrated while its decode nodes die (or every sample, n > 1)."""
    r.acc.model_used = r.attempt.model.name
    s = r.first_sample()
    leg = await r.open_leg(s, r.attempt)
    if r.request.n > 1:  # samples 1..n-1 start on sample 0's node; each migrates on its own
        async for piece in fan_out(r, leg, s):
            yield piece
        return
    while True:
        s.failure = None
        async for piece in r.follow(leg, s):
            yield piece
        if s.failure is None:
            return
        leg = await migrate(r, s, s.failure)
