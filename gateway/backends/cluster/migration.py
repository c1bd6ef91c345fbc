"""Stream migration: a decode node died (or froze: no chunk within `[routing] stall_timeout_s`,
node_client.py) after tokens went out. The prompt plus the tokens streamed go to another node —
routed like any request, the dead node excluded: prefix cache and P/D as usual — under the
request id `<id>.m<N>`, with `Resume` (protocol/resume.py) telling it where the output stands,
so it continues the text where the client's stops (a guided request's prefill leg carries it
too: P's token is the output's next); the client's stream goes on. With n > 1 each sample not
finished migrates on its own (its own streamed ids, seed and limits: fanout.py). Bounded by
`[routing] max_migrations` and `migration_deadline_s`; past them, or when no node can continue,
`MidStreamError` (the API layer sends an SSE error event; a whole answer becomes a 502).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from gateway.backends.base import MidStreamError
from gateway.backends.cluster.legs import DecodeLeg
from gateway.backends.cluster.request import ClusterRequest
from gateway.backends.cluster.samples import SampleStream
from gateway.backends.node_client import NodeFailure
from protocol.openai import APIError
from protocol.resume import Resume
from runtime.tracing import Attrs

log = logging.getLogger("duet.gateway.cluster")


def _refuse(r: ClusterRequest, s: SampleStream, failure: NodeFailure) -> None:
    """MidStreamError when the stream may not move again (its limits)."""
    cfg = r.nodes.cfg
    if s.migrations + 1 > cfg.max_migrations:
        raise MidStreamError(
            502,
            f"the decode node failed mid-stream ({failure}) and the stream was migrated "
            f"{s.migrations} times already ([routing] max_migrations)",
            type_="upstream_error",
            code="migration_limit_reached",
        )
    if time.monotonic() - s.t0 > cfg.migration_deadline_s:
        raise MidStreamError(
            502,
            f"the decode node failed mid-stream ({failure}) past the request's migration "
            f"deadline ([routing] migration_deadline_s = {cfg.migration_deadline_s})",
            type_="upstream_error",
            code="migration_deadline_exceeded",
        )


async def migrate(r: ClusterRequest, s: SampleStream, failure: NodeFailure) -> DecodeLeg:
    """Sample `s`'s stream on another node, from where its client's output stands."""
    _refuse(r, s, failure)
    n = s.migrations + 1
    # sample i > 0 runs under `<id>.<i>`; each of its migrations under that id's `.m<N>`
    rid = r.attempt.request_id if s.index == 0 else f"{r.attempt.request_id}.{s.index}"
    attempt = replace(r.attempt, request_id=rid)
    log.warning(
        "%s: decode on %s failed mid-stream after %d tokens (%s); migrating the stream "
        "(%d of at most %d)",
        attempt.request_id,
        s.node_id,
        len(s.ids),
        failure.reason,
        n,
        r.nodes.cfg.max_migrations,
    )
    r.nodes.on_retry("migration")
    r.nodes.abort_later({s.leg})  # a node that only stalled must not go on decoding for nobody
    if failure.unreachable:  # frozen or cut off: later requests go elsewhere for a while too
        r.nodes.unreachable.mark(s.node_id, failure.reason)
    s.migrations = n
    r.acc.migrations += 1  # every sample's migrations
    s.exclude.append(s.node_id)
    s.base = len(s.ids)
    s.resume = Resume(output_tokens=len(s.ids), text_chars=s.chars, migration=n) if s.ids else None
    leg_attempt = replace(
        attempt, request_id=f"{attempt.request_id}.m{n}", prompt_ids=attempt.prompt_ids + s.ids
    )
    attrs: Attrs = {
        "duet.migration": n,
        "duet.failed_node_id": s.node_id,
        "duet.reason": failure.reason,
        "duet.streamed_tokens": len(s.ids),
    }
    try:
        with r.nodes.tracing.span("gateway.migration", attrs):
            return await r.open_leg(s, leg_attempt)
    except APIError as e:
        raise MidStreamError(
            502,
            f"the decode node failed mid-stream ({failure}) and no node could continue "
            f"the stream: {e.message}",
            type_="upstream_error",
            code="upstream_failed_midstream",
        ) from None
