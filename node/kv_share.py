"""A node's KV as a source for its peers: `POST /kv/share` and `POST /kv/share/release`.

Any node with a transport serves them, whatever its role: a decode node holds the KV of the
turns it generated, which the next turn's prefill node pulls (node/kv_pull.py). A share holds
the leading blocks of the asked hashes that this node has — in its pool, or loaded back from a
spill tier and checked — under a lease (`lease_s`, at most MAX_LEASE_S): the engine frees them
at its end, on a release, or when the node aborts the request id. The answer names the blocks,
their content digests and the engine whose pool holds them; the reader checks the bytes it read
against the digests, so a release is a courtesy, never what vouches for the bytes.

Cache domains: the hashes are salted by the prompt's domain (`cache_salt` names it for the
spilled blocks' checks), so a share can only ever find blocks of that domain. Both endpoints
are internal (the cluster secret guards them, as every /kv/ endpoint).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import msgspec
from aiohttp import web

from node.engine_api import RequestRefused
from node.state import NodeState
from protocol.node_api import KVShareAnswer, KVShareRelease, KVShareRequest
from protocol.openai import APIError

log = logging.getLogger("duet.node")
T = TypeVar("T")
Handler = Callable[[NodeState, web.Request], Awaitable[web.StreamResponse]]
#: the longest a peer may ask a share to be held (seconds)
MAX_LEASE_S = 60.0
#: blocks one share may ask for (a prompt of the longest contexts in 16-token blocks)
MAX_SHARE_BLOCKS = 65536


def share_id(request_id: str) -> str:
    """The engine's id of the share a peer asked for request `request_id`."""
    return f"share:{request_id}"


def _decode(raw: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(raw, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"malformed {kind.__name__}: {e}") from None


async def handle_share(state: NodeState, request: web.Request) -> web.Response:
    if state.transport is None:
        raise APIError(404, "this node has no KV transport; it shares no KV")
    body = _decode(await request.read(), KVShareRequest)
    if not body.request_id or len(body.block_hashes) > MAX_SHARE_BLOCKS:
        raise APIError(400, f"a share names a request id and at most {MAX_SHARE_BLOCKS} hashes")
    if any(not 0 <= h < 2**64 for h in body.block_hashes):
        raise APIError(400, "block hashes are unsigned 64-bit integers", param="block_hashes")
    if not 0 < body.lease_s <= MAX_LEASE_S:
        raise APIError(400, f"lease_s must be in (0, {MAX_LEASE_S:g}]", param="lease_s")
    try:
        held = await state.engine.share_prefix(
            share_id(body.request_id), body.block_hashes, body.cache_salt, body.lease_s
        )
    except RequestRefused as e:
        raise APIError(409, str(e), code="share_in_use") from None
    if held.block_ids:
        state.transport.expect_reads(body.lease_s)
    answer = KVShareAnswer(
        engine_id=state.engine_id, block_ids=held.block_ids, block_digests=held.digests or []
    )
    log.info(
        "sharing %d of %d blocks asked for %s",
        len(held.block_ids),
        len(body.block_hashes),
        body.request_id,
    )
    return web.Response(body=msgspec.json.encode(answer), content_type="application/json")


async def handle_share_release(state: NodeState, request: web.Request) -> web.Response:
    body = _decode(await request.read(), KVShareRelease)
    try:
        n = await state.engine.release_share(share_id(body.request_id), body.block_ids)
    except RequestRefused as e:
        raise APIError(400, str(e), param="block_ids") from None
    if n is None:
        raise APIError(
            404, f"no blocks are shared for request {body.request_id!r}", code="not_held"
        )
    return web.json_response({"released": n})


def add_share_routes(
    app: web.Application,
    bind: Callable[[Handler], Callable[[web.Request], Awaitable[web.StreamResponse]]],
) -> None:
    """Register the endpoints (`bind` turns a (state, request) handler into a route's)."""
    app.router.add_post("/kv/share", bind(handle_share))
    app.router.add_post("/kv/share/release", bind(handle_share_release))
