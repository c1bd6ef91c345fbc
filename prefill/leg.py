"""The prefill leg and the prefill node's KV endpoints.

Prefill leg: compute the prompt (reusing the prefix cache) with max_tokens=1 and have the
engine hold its blocks for `lease_s` — the hold and its lease are one engine-side state,
created atomically when the request finishes, so a client that disconnects at any moment
cannot leak blocks: the engine frees them at the deadline, on `/kv/release`, or on `/abort`.
Answer with vLLM-named `kv_transfer_params` telling a decode node where to pull them from —
and, for a guided request, the token P sampled under the guide's mask (`first_token_id`), which
D emits as the output's first token and continues the grammar from. On a migrated
guided leg the request carries `resume`, so P's matcher, penalties and seeded draws start after
the tokens already streamed, as D's do.
`/kv/release` frees them (checking the block ids belong to the request) and says 404 when
nothing was held.
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from node.engine_api import KVHandoff, RequestRefused, SamplingParams
from node.legs import LegContext, Node, prefill_request_id
from protocol.kv_params import KVTransferParams
from protocol.node_api import KVReleaseRequest, NodeCompletion
from protocol.openai import APIError

log = logging.getLogger("duet.prefill")


async def prefill_leg(leg: LegContext) -> web.StreamResponse:
    prep, node = leg.prep, leg.node
    if prep.body.stream:
        raise APIError(400, "a prefill leg (do_remote_decode) cannot stream", param="stream")
    if node.transport is None:
        raise APIError(503, "this node has no KV transport; it cannot serve prefill legs")
    params = prep.params
    params.max_tokens = (
        1  # P computes the prompt and samples the first token (D uses a guided leg's)
    )
    lease = node.config.lease_s
    result = await leg.collect(await leg.start(params, KVHandoff(hold_seconds=lease)))
    held = await node.engine.held_kv(leg.engine_request_id)
    if held is None or not held.block_ids:
        raise APIError(
            500, "prefill finished without holding its KV blocks", type_="internal_error"
        )
    cfg = node.config
    result.kv_transfer_params = KVTransferParams(
        first_token_id=_first_token(prep.params, result),
        do_remote_prefill=True,
        remote_engine_id=node.engine_id,
        remote_block_ids=list(held.block_ids),
        remote_block_digests=held.digests,
        remote_request_id=prep.request_id,
        remote_host=cfg.public_host,
        remote_port=cfg.port,
        remote_num_tokens=len(prep.prompt_ids),
        lease_seconds=lease,
    )
    node.transport.expect_reads(lease)  # D pulls within the lease: keep our UCX progress prompt
    log.info(
        "prefilled %d tokens into %d blocks, held for %.0fs",
        len(prep.prompt_ids),
        len(held.block_ids),
        lease,
    )
    # from now until D's release (or the lease's end: `untracked`), in this leg's trace
    node.tracing.defer(
        _hold_key(prep.request_id),
        "prefill.hold",
        {"duet.kv.blocks": len(held.block_ids), "duet.lease_s": lease},
    )
    return leg.answer(result)


def _first_token(params: SamplingParams, result: NodeCompletion) -> int | None:
    """The token this leg sampled, for D to continue from — a guided leg's only (the
    grammar's state must be the one P's token leads to). An unguided request's first token is
    sampled again on D from the last prompt position, as before."""
    if params.guide is None:
        return None
    ids = result.choices[0].token_ids if result.choices else None
    if not ids:  # the leg ended without a token (an error finishes it before: see collect)
        raise APIError(500, "the guided prefill leg sampled no token", type_="internal_error")
    return ids[0]


async def handle_release(state: Node, request: web.Request) -> web.Response:
    try:
        body = msgspec.json.decode(await request.read(), type=KVReleaseRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"malformed release request: {e}") from None
    try:
        n = await state.engine.release_held(prefill_request_id(body.request_id), body.block_ids)
    except RequestRefused:
        raise APIError(
            400,
            f"block ids {body.block_ids} do not belong to request {body.request_id!r}",
            param="block_ids",
        ) from None
    state.tracing.finish(
        _hold_key(body.request_id), {"duet.outcome": "released" if n is not None else "not_held"}
    )
    if n is None:
        raise APIError(
            404,
            f"no blocks are held for request {body.request_id!r} (released, "
            "lease expired, or never prefilled here)",
            code="not_held",
        )
    return web.json_response({"released": n})


async def abort_held(state: Node, request_id: str) -> bool:
    """`POST /abort`: drop the prefill leg of `request_id` (running or held)."""
    state.tracing.finish(_hold_key(request_id), {"duet.outcome": "aborted"})
    return await state.engine.abort(prefill_request_id(request_id))


def _hold_key(request_id: str) -> str:
    return f"hold:{request_id}"
