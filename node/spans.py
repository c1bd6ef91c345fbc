"""`GET /spans?trace_id=<32 hex>`: this node's recent spans of one trace, for the console's
request view (gateway/console/node_spans.py merges them under the gateway's leg spans).

When tracing is on a node keeps its last NODE_RING finished spans in memory (runtime/tracing's
`SpanRing`, beside any OTLP export), so one request's P and D spans are seen without a collector.

Invariants: an internal endpoint like the legs — the cluster secret's middleware refuses it
without `Authorization: Bearer <secret>` (401) before this handler runs; the trace id is
validated (400 unless 32 lower-case hex digits, not all zero); the answer holds that trace's
spans only, at most MAX_TRACE_SPANS; a node without a ring answers `kept: false`. The request
itself is not traced (the tracing middleware skips `/spans`), so reading the ring never fills it.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from node.state import NodeState
from protocol.node_api import NodeSpans
from protocol.openai import APIError
from runtime.tracing import MAX_TRACE_SPANS, valid_trace_id


async def handle_spans(state: NodeState, request: web.Request) -> web.Response:
    trace_id = request.query.get("trace_id", "")
    if not valid_trace_id(trace_id):
        raise APIError(
            400,
            f"trace_id must be a W3C trace id (32 lower-case hex digits, not all zero), not "
            f"{trace_id[:40]!r}",
            param="trace_id",
        )
    ring = state.tracing.ring
    if ring is None:
        body = NodeSpans(node_id=state.node_id, kept=False)
    else:
        spans = ring.trace(trace_id, limit=MAX_TRACE_SPANS + 1)
        body = NodeSpans(
            node_id=state.node_id,
            kept=True,
            spans=spans[:MAX_TRACE_SPANS],
            truncated=len(spans) > MAX_TRACE_SPANS,
        )
    return web.Response(body=msgspec.json.encode(body), content_type="application/json")
