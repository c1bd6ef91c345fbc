"""What a coordinator replica knows about one node: its registration, its last load report,
the state of its event stream, and the routing decisions its load has not shown yet.

Pending decisions (so a burst does not herd onto one node): each route adds the sequences,
prefill tokens and KV blocks it sends to a node, as a reservation named by its ticket (the
request's X-Request-Id, which the gateway sends the node). A reservation counts exactly until
the node's load shows the request:
- a node that acknowledges routes (LoadFrame.taken not None) names, in each load frame, the
  requests its engine took since its previous frame on this stream; their reservations end on
  that frame, whose counters (running/waiting/queued tokens, free blocks) now carry the request
  — or no longer do, if it already finished: either way counting the reservation too would
  count it twice. Routed requests that never reach the node (the gateway failed over to another
  node) expire after `max_age_s`;
- entries without a ticket, and all entries of a node that does not acknowledge, keep the
  older rule: they stop counting at the first load report received `settle_s` after the
  decision, and at the latest after `max_age_s`.
Free blocks seen by admission are the frame's minus the reservations not yet in it, so one
request's blocks are never subtracted twice. (The native engine republishes its counters when it
takes a request, so the frame that acks it counts it; an engine that publishes only after each
step — the vLLM node's — leaves a request counted by neither for up to a step: the error is on the
side of admitting, which the node's own queue absorbs.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import count

from protocol.cluster import NodeInfo
from protocol.kv_events import LoadFrame


@dataclass
class Pending:
    at: float
    seqs: int
    prefill_tokens: int
    blocks: int
    #: the route's ticket (X-Request-Id); None: only the settle time ends it
    ticket: str | None = None


#: seconds a replica counts an adapter it loaded onto a node as held before the node's load
#: frames list it (they come every 0.2 s)
ADAPTER_GRACE_S = 5.0
#: keys of untagged reservations (ints never equal a ticket string)
_untagged = count()


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
    #: reservations by ticket (or an int for an untagged one), oldest first
    pending: dict[str | int, Pending] = field(default_factory=dict)
    _totals: PendingTotals = field(default_factory=PendingTotals)

    #: = info.node_id (a plain attribute: the router reads it often)
    node_id: str = ""
    #: LoRA adapters this replica loaded onto the node (coordinator/lora.py) → monotonic time of
    #: the load: counted as held until the node's load frames list them, for ADAPTER_GRACE_S
    adapters_loaded: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.node_id = self.info.node_id

    def holds_adapter(self, name: str) -> bool:
        """Whether the node holds LoRA adapter `name` (its last load frame lists it, or this
        replica loaded it since)."""
        if self.load is not None and name in (self.load.lora_adapters or ()):
            return True
        at = self.adapters_loaded.get(name)
        return at is not None and time.monotonic() - at < ADAPTER_GRACE_S

    def ready(self, now: float, stale_s: float) -> bool:
        """Routable: its stream is up and its load report is fresh."""
        return self.connected and self.load is not None and now - self.load_at <= stale_s

    def add_pending(
        self, now: float, seqs: int, prefill_tokens: int, blocks: int, ticket: str | None = None
    ) -> None:
        t = self._totals
        t.seqs, t.prefill_tokens, t.blocks = (
            t.seqs + seqs,
            t.prefill_tokens + prefill_tokens,
            t.blocks + blocks,
        )
        old = self.pending.get(ticket) if ticket is not None else None
        if old is not None:  # routed again (its first target failed): one request, one reservation
            old.seqs, old.prefill_tokens, old.blocks = (
                old.seqs + seqs,
                old.prefill_tokens + prefill_tokens,
                old.blocks + blocks,
            )
            return
        self.pending[next(_untagged) if ticket is None else ticket] = Pending(
            now, seqs, prefill_tokens, blocks, ticket
        )

    def _drop(self, key: str | int) -> None:
        p, t = self.pending.pop(key), self._totals
        t.seqs, t.prefill_tokens, t.blocks = (
            t.seqs - p.seqs,
            t.prefill_tokens - p.prefill_tokens,
            t.blocks - p.blocks,
        )

    def on_load(self, frame: LoadFrame, now: float, settle_s: float) -> None:
        self.load, self.load_at = frame, now
        if self.adapters_loaded and frame.lora_adapters is not None:
            # listed: the frames are the truth from here on (it may be evicted later)
            for name in frame.lora_adapters:
                self.adapters_loaded.pop(name, None)
        if not self.pending:
            return
        acks = frame.taken is not None
        if acks:
            for ticket in frame.taken or ():
                if ticket in self.pending:
                    self._drop(ticket)
        # The settle rule (entries are oldest first): every entry of a node that does not ack,
        # the untagged ones of a node that does.
        settled: list[str | int] = []
        for key, p in self.pending.items():
            if now - p.at < settle_s:
                break
            if p.ticket is None or not acks:
                settled.append(key)
        for key in settled:
            self._drop(key)

    def pending_totals(self, now: float, max_age_s: float) -> PendingTotals:
        """Sums over the pending decisions (kept as running totals: O(1) per route)."""
        while self.pending:
            key, p = next(iter(self.pending.items()))
            if now - p.at <= max_age_s:
                break
            self._drop(key)
        t = self._totals
        return PendingTotals(t.seqs, t.prefill_tokens, t.blocks)
