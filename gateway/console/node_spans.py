"""The nodes' spans of one trace, for the console's request view (pages.trace).

The gateway's ring holds its own spans of a request; the P and D legs' spans (queue, compute,
hold; reserve, KV pull, first token, generate) live in the rings of the nodes that served it
(node/spans.py). For a trace it shows, the console asks those nodes for their spans of that
trace, all at once, each within FETCH_TIMEOUT_S, and merges them with its own: a node's SERVER
span is the child of the gateway's leg span through `traceparent`, so the span ids alone join
the tree (`tree`).

Invariants: the nodes asked are those the gateway's own leg spans name (`duet.node_id`, and
`server.address`: the URL the gateway itself called, from its router — never an address from a
client), at most MAX_NODES; the request carries the cluster secret as every internal call does;
an answer is read up to MAX_ANSWER_BYTES and only its spans of the asked trace are kept. A node
that is gone, slow or refusing costs a note on the page (`NodeSpansResult.detail`), never the page.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import aiohttp
import msgspec

from gateway.state import GatewayState
from protocol.node_api import NodeSpans
from runtime.tracing import SERVER_ADDRESS, SpanRecord

#: the gateway's spans of a call to a node (gateway/backends/cluster/backend.py), whose nodes are
#: asked
LEG_SPANS = ("gateway.prefill_leg", "gateway.decode_leg")
#: how long the page waits for a node (a dead node's connect, a stuck one's answer)
FETCH_TIMEOUT_S = 2.0
#: nodes asked for one trace at most (a request migrated a few times names a few decode nodes)
MAX_NODES = 8
#: bytes of one node's answer read at most (MAX_TRACE_SPANS spans with their attributes)
MAX_ANSWER_BYTES = 4 << 20


class Fetched(enum.Enum):
    OK = "ok"
    #: the node keeps no spans (tracing is off on it)
    NOT_KEPT = "not_kept"
    #: gone, timed out, refused, or answered what is not a NodeSpans
    UNAVAILABLE = "unavailable"


@dataclass(frozen=True)
class NodeSpansResult:
    node_id: str
    url: str
    outcome: Fetched
    spans: list[SpanRecord] = field(default_factory=list)
    #: why the spans are missing (UNAVAILABLE), or that the node cut its answer (truncated)
    detail: str = ""


def served_by(spans: Iterable[SpanRecord]) -> dict[str, str]:
    """URL → node id of the nodes the gateway's leg spans called, in the order first called."""
    out: dict[str, str] = {}
    for x in sorted(spans, key=lambda x: x.start_ns):
        url, node_id = x.attributes.get(SERVER_ADDRESS), x.attributes.get("duet.node_id")
        if (
            x.name in LEG_SPANS
            and isinstance(url, str)
            and isinstance(node_id, str)
            and url not in out
        ):
            out[url] = node_id
    return dict(list(out.items())[:MAX_NODES])


async def _read_capped(r: aiohttp.ClientResponse) -> bytes:
    data = bytearray()
    async for chunk in r.content.iter_chunked(1 << 16):
        data += chunk
        if len(data) > MAX_ANSWER_BYTES:
            raise ValueError(f"the answer is larger than {MAX_ANSWER_BYTES} bytes")
    return bytes(data)


async def _one(state: GatewayState, trace_id: str, url: str, node_id: str) -> NodeSpansResult:
    try:
        async with state.session.get(
            f"{url.rstrip('/')}/spans",
            params={"trace_id": trace_id},
            headers=state.config.security.headers,
            timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S),
        ) as r:
            if r.status != 200:
                return NodeSpansResult(
                    node_id, url, Fetched.UNAVAILABLE, detail=f"it answered HTTP {r.status}"
                )
            got = msgspec.json.decode(await _read_capped(r), type=NodeSpans)
    except TimeoutError:
        return NodeSpansResult(
            node_id, url, Fetched.UNAVAILABLE, detail=f"no answer within {FETCH_TIMEOUT_S:.0f} s"
        )
    except (
        aiohttp.ClientError,
        OSError,
        ValueError,
        msgspec.DecodeError,
    ) as e:  # ValidationError is a DecodeError
        return NodeSpansResult(
            node_id, url, Fetched.UNAVAILABLE, detail=f"{type(e).__name__}: {e}"[:200]
        )
    if not got.kept:
        return NodeSpansResult(node_id, url, Fetched.NOT_KEPT)
    spans = [x for x in got.spans if x.trace_id == trace_id]
    return NodeSpansResult(
        node_id,
        url,
        Fetched.OK,
        spans,
        detail="more spans than one answer carries; the first are shown" if got.truncated else "",
    )


async def fetch(
    state: GatewayState, trace_id: str, spans: Sequence[SpanRecord]
) -> list[NodeSpansResult]:
    """The spans of `trace_id` held by each node the gateway's `spans` (that trace's) called."""
    nodes = served_by(spans)
    if not nodes:
        return []
    return list(
        await asyncio.gather(*(_one(state, trace_id, url, nid) for url, nid in nodes.items()))
    )


def tree(spans: Sequence[SpanRecord]) -> list[tuple[SpanRecord, int]]:
    """`spans` (one trace's, from every process; duplicates by span id dropped) in tree order with
    each one's depth: a child right under its parent, siblings by start time; a span whose
    parent is not among them is a root."""
    by_id: dict[str, SpanRecord] = {}
    for x in spans:
        by_id.setdefault(x.span_id, x)
    kids: dict[str | None, list[SpanRecord]] = {}
    for x in sorted(by_id.values(), key=lambda x: (x.start_ns, x.end_ns)):
        kids.setdefault(x.parent_id if x.parent_id in by_id else None, []).append(x)
    out: list[tuple[SpanRecord, int]] = []
    seen: set[str] = set()
    stack = [(x, 0) for x in reversed(kids.get(None, []))]
    while stack:
        x, d = stack.pop()
        if x.span_id in seen:
            continue
        seen.add(x.span_id)
        out.append((x, d))
        stack.extend((k, d + 1) for k in reversed(kids.get(x.span_id, [])))
    return out
