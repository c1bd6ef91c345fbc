"""`n > 1`: the nodes take one sample per request, so sample 0 runs the P → D legs; once its
first token is out its prompt KV sits in D's prefix cache, and samples 1..n-1 run on the same
D as local legs (ids `<X-Request-Id>.<i>`) whose prompt is served from that cache (its full
blocks: only the last partial block is recomputed). Their chunks meet on one queue; a sample
whose node fails before its last token migrates alone (migration.py, `<its id>.m<N>`), in a
task of its own, while the others' pieces go on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.backends.base import Piece, midstream
from gateway.backends.cluster.legs import Chunk, DecodeLeg, Item, NodeStream, leg_request
from gateway.backends.cluster.migration import migrate
from gateway.backends.cluster.request import ClusterRequest
from gateway.backends.cluster.samples import SampleStream
from gateway.backends.node_client import NodeFailure
from runtime.tracing import GEN_AI_OUTPUT_TOKENS


def _sample(r: ClusterRequest, leg: DecodeLeg, s0: SampleStream, i: int) -> SampleStream:
    """Sample i > 0 on sample 0's node: distinct draws (seed + i), still reproducible."""
    seed = r.request.sampling.seed
    rid = f"{r.attempt.request_id}.{i}"
    r.touched.add((leg.url, rid))
    s = SampleStream(
        t0=s0.t0,
        index=i,
        seed=None if seed is None else seed + i,
        node_id=s0.node_id,
        leg=(leg.url, rid),
        exclude=list(s0.exclude),
    )
    return s


async def fan_out(r: ClusterRequest, leg: DecodeLeg, s0: SampleStream) -> AsyncIterator[Piece]:
    """Sample 0's stream and samples 1..n-1 on the same node, interleaved."""
    samples = [s0] + [_sample(r, leg, s0, i) for i in range(1, r.request.n)]
    queue: asyncio.Queue[Item] = asyncio.Queue()
    tasks = [asyncio.ensure_future(leg.stream.pump(queue, leg.head))]
    for s in samples[1:]:
        body = leg_request(r.request, r.attempt, s.decode_fields(r.request, r.attempt, None))
        stream = NodeStream(r.nodes.client, r.nodes.load, leg.url, s.leg[1], s.index, body)
        tasks.append(asyncio.ensure_future(stream.pump(queue, None)))
    try:
        running = len(samples)
        while running:
            i, item = await queue.get()
            s = samples[i]
            if item is None or (isinstance(item, NodeFailure) and s.finished):
                running -= 1  # (a node that died after the sample's last token owes nothing)
                s.leg_ended(r.acc, r.nodes.tracing)
            elif isinstance(item, NodeFailure):  # every piece before it went out: s is whole
                s.leg_ended(r.acc, r.nodes.tracing, item.reason)
                tasks.append(asyncio.ensure_future(_migrate(r, s, item, queue)))
            elif isinstance(item, BaseException):
                raise midstream(item)
            else:
                for piece in s.pieces(item, r.acc):
                    yield piece
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in samples:  # legs still open: the request ended early
            made = len(s.ids) - s.base
            r.nodes.tracing.end(s.span, {GEN_AI_OUTPUT_TOKENS: made}, error="ended early")
            s.span = None


async def _migrate(
    r: ClusterRequest, s: SampleStream, failure: NodeFailure, queue: asyncio.Queue[Item]
) -> None:
    """One sample moves to another node; its pieces join the queue from there."""
    try:
        leg = await migrate(r, s, failure)
    except asyncio.CancelledError:
        raise
    except Exception as e:
        await queue.put((s.index, e))
        return
    head: Chunk = leg.head
    await leg.stream.pump(queue, head)
