"""What every request of the cluster backend reaches its nodes with: the node client, the router,
the nodes' in-flight counts, the routing settings, tracing, the retry counter, the nodes this
gateway could not reach lately (unreachable.py), and the aborts still in flight (`POST /abort`
to what a request touched, in a task the client's cancellation cannot stop; `drain` waits for
them at shutdown)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from gateway.backends.cluster.unreachable import Unreachable
from gateway.backends.node_client import NodeClient
from gateway.backends.routing import NodeLoad, Router
from gateway.config import RoutingConfig
from runtime.tracing import Tracing

#: a node URL and the request id a leg ran under there
Touch = tuple[str, str]


class Nodes:
    def __init__(
        self,
        client: NodeClient,
        router: Router,
        load: NodeLoad,
        cfg: RoutingConfig,
        on_retry: Callable[[str], None],
        tracing: Tracing,
    ) -> None:
        self.client = client
        self.router = router
        self.load = load
        self.cfg = cfg
        #: counts a retry by kind ("route", "migration")
        self.on_retry = on_retry
        self.tracing = tracing
        self.unreachable = Unreachable(cfg.unreachable_exclude_s)
        self._cleanup: set[asyncio.Task[None]] = set()  # strong refs to abort tasks

    async def abort(self, items: Iterable[Touch]) -> None:
        """`POST /abort` to each, now."""
        await asyncio.gather(*(self.client.abort(url, rid) for url, rid in items))

    def abort_later(self, items: Iterable[Touch]) -> None:
        """`POST /abort` to each, in a task the client's cancellation cannot stop."""
        task = asyncio.ensure_future(self.abort(set(items)))
        self._cleanup.add(task)
        task.add_done_callback(self._cleanup.discard)

    async def drain(self) -> None:
        """Wait for pending aborts (at shutdown)."""
        if self._cleanup:
            await asyncio.gather(*self._cleanup, return_exceptions=True)
