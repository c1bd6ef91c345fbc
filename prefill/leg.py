"""The prefill leg and the prefill node's KV endpoints.

Prefill leg: compute the prompt (reusing the prefix cache) with max_tokens=1, keep its blocks
under a lease, and answer with vLLM-named `kv_transfer_params` telling a decode node where
to pull them from. `/kv/release` frees them (checking the block ids belong to the request);
`/kv/metadata` serves this node's transport metadata (the handshake of DESIGN §4).
"""

from __future__ import annotations

import logging

import msgspec
from aiohttp import web

from node.completions import Prepared, prefill_request_id, start
from node.responder import Responder
from node.state import NodeState
from protocol.kv_params import KVTransferParams
from protocol.node_api import KVReleaseRequest
from protocol.openai import APIError

log = logging.getLogger("duet.prefill")


async def prefill_leg(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    if prep.body.stream:
        raise APIError(400, "a prefill leg (do_remote_decode) cannot stream", param="stream")
    if state.transport is None:
        raise APIError(503, "this node has no KV transport; it cannot serve prefill legs")
    erid = prefill_request_id(prep.request_id)
    params = prep.params
    params.max_tokens = 1  # P computes the prompt; the first real token comes from D
    state.enter(erid)
    try:
        stream = await start(state, erid, prep, params, hold_blocks=True)
        responder = Responder(state, prep.request_id, erid, prep.arrival)
        result = await responder.collect(stream, state.engine.model_name)
    finally:
        state.leave(erid)
    blocks = await state.engine.held_blocks(erid)
    if not blocks:
        raise APIError(500, "prefill finished without holding its KV blocks")
    lease = state.config.lease_seconds
    state.leases.hold(erid, lease)
    cfg = state.config
    result.kv_transfer_params = msgspec.structs.asdict(KVTransferParams(
        do_remote_prefill=True, remote_engine_id=state.engine_id, remote_block_ids=blocks,
        remote_request_id=prep.request_id, remote_host=cfg.public_host, remote_port=cfg.port,
        remote_num_tokens=len(prep.prompt_ids), lease_seconds=lease,
    ))  # fmt: skip
    log.info("prefilled %d tokens into %d blocks, held for %.0fs", len(prep.prompt_ids), len(blocks), lease)
    return web.Response(body=msgspec.json.encode(result), content_type="application/json",
                        headers={"X-Request-Id": prep.request_id})  # fmt: skip


async def handle_release(state: NodeState, request: web.Request) -> web.Response:
    try:
        body = msgspec.json.decode(await request.read(), type=KVReleaseRequest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise APIError(400, f"malformed release request: {e}") from None
    erid = prefill_request_id(body.request_id)
    held = await state.engine.held_blocks(erid)
    if held is None:
        raise APIError(404, f"no blocks are held for request {body.request_id!r} (released, "
                            "lease expired, or never prefilled here)", code="not_held")  # fmt: skip
    if body.block_ids is not None and list(body.block_ids) != held:
        raise APIError(400, f"block ids {body.block_ids} do not belong to request "
                            f"{body.request_id!r}", param="block_ids")  # fmt: skip
    await state.leases.release(erid)
    return web.json_response({"released": len(held)})


async def handle_metadata(state: NodeState, request: web.Request) -> web.Response:
    if state.transport is None:
        raise APIError(404, "this node has no KV transport")
    from kvtransfer import METADATA_CONTENT_TYPE

    return web.Response(body=state.transport.metadata_bytes(), content_type=METADATA_CONTENT_TYPE)
