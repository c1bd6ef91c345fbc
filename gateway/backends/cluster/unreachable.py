"""The nodes this gateway could not reach lately, left out of its routing for a while.

etcd and the coordinators see a node from where they stand: a node partitioned from this
gateway alone, or frozen with its lease still fresh, stays listed and routed to. Each request
sent there would pay a connect deadline (or a stall bound) before trying another node. So a
node whose call failed as unreachable (`NodeFailure.unreachable`: no connect, no
acknowledgement, a stalled stream) is added to every route request's `exclude` for
`[routing] unreachable_exclude_s`; after that the next request tries it again (one deadline
paid per period while the fault lasts). If leaving them out leaves no node, the route is asked
again without them: a node that may answer beats a certain 503.

Invariant: only this gateway's own failed calls put a node here; nothing here is shared with
other gateways or outlives the process.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("duet.gateway.cluster")


class Unreachable:
    def __init__(self, exclude_s: float) -> None:
        self.exclude_s = exclude_s
        #: node id → monotonic time until which it is left out
        self._until: dict[str, float] = {}

    def mark(self, node_id: str, reason: str) -> None:
        """`node_id` failed as unreachable: leave it out for `exclude_s` from now."""
        if self.exclude_s <= 0:
            return
        now = time.monotonic()
        if self._until.get(node_id, 0.0) <= now:
            log.warning(
                "node %s unreachable from this gateway (%s): left out of routing for %g s",
                node_id,
                reason,
                self.exclude_s,
            )
        self._until[node_id] = now + self.exclude_s

    def node_ids(self) -> list[str]:
        """The nodes left out now (expired ones dropped)."""
        now = time.monotonic()
        for node_id in [n for n, t in self._until.items() if t <= now]:
            del self._until[node_id]
        return list(self._until)
