"""What a coordinator replica knows about one node: its registration, its last load report,
the state of its event stream, and the routing decisions its load has not shown yet.

Pending decisions (so a burst does not herd onto one node): each route adds the sequences,
prefill tokens and KV blocks it sends to a node. An entry stops counting at the first load
report received `settle_s` after the decision (by then the node's own counters include the
request, if it arrived), and at the latest after `max_age_s` (a node that stops reporting is
not routable anyway).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol.cluster import NodeInfo
from protocol.kv_events import LoadFrame


@dataclass
class Pending:
    at: float
    seqs: int
    prefill_tokens: int
    blocks: int


@dataclass
class PendingTotals:
    seqs: int = 0
    prefill_tokens: int = 0
    blocks: int = 0


@dataclass
class NodeView:
    info: NodeInfo
    load: LoadFrame | None = None
    #: monotonic time the last load frame arrived
    load_at: float = 0.0
    connected: bool = False
    #: last event batch applied to the index
    seq: int = 0
    engine_id: str | None = None
    resyncs: int = 0
    last_event_lag_s: float = 0.0
    pending: deque[Pending] = field(default_factory=deque)
    _totals: PendingTotals = field(default_factory=PendingTotals)

    #: = info.node_id (a plain attribute: the router reads it often)
    node_id: str = ""

    def __post_init__(self) -> None:
        self.node_id = self.info.node_id

    def ready(self, now: float, stale_s: float) -> bool:
        """Routable: its stream is up and its load report is fresh."""
        return self.connected and self.load is not None and now - self.load_at <= stale_s

    def add_pending(self, now: float, seqs: int, prefill_tokens: int, blocks: int) -> None:
        self.pending.append(Pending(now, seqs, prefill_tokens, blocks))
        t = self._totals
        t.seqs, t.prefill_tokens, t.blocks = t.seqs + seqs, t.prefill_tokens + prefill_tokens, t.blocks + blocks

    def _pop(self) -> None:
        p, t = self.pending.popleft(), self._totals
        t.seqs, t.prefill_tokens, t.blocks = t.seqs - p.seqs, t.prefill_tokens - p.prefill_tokens, t.blocks - p.blocks

    def on_load(self, frame: LoadFrame, now: float, settle_s: float) -> None:
        self.load, self.load_at = frame, now
        while self.pending and now - self.pending[0].at >= settle_s:
            self._pop()

    def pending_totals(self, now: float, max_age_s: float) -> PendingTotals:
        """Sums over the pending decisions (kept as running totals: O(1) per route)."""
        while self.pending and now - self.pending[0].at > max_age_s:
            self._pop()
        t = self._totals
        return PendingTotals(t.seqs, t.prefill_tokens, t.blocks)
