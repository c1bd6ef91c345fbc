"""The decode leg: pull the prompt's KV from the prefill node, then decode and stream.

Order (each step can fail with a defined answer, never a hang):
1. validate `kv_transfer_params` (4xx for anything malformed or inconsistent with the prompt);
2. get the peer (cached metadata, or fetched from P; an engine id P does not run → 400);
3. reserve local blocks in the engine (WAITING_FOR_REMOTE_KV; a local prefix hit skips blocks);
4. READ P's blocks with the transport, under a timeout;
5. release on P, checking the ids belong to the request: 400 → the client's params were wrong
   (the request is aborted and the client gets a 400); 404 → the lease ran out before we were
   done, the bytes may be stale → treat as failed;
6. mark the KV ready (the engine recomputes the last prompt token for its logits), or on any
   failure apply the policy: `recompute` (prefill locally) or `fail` (an error to the client).
Steps 4-6 run in a task the client cannot cancel: the engine must learn the transfer's end
before it may free blocks the transfer writes into.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web

from decode.remote_kv import PeerUnreachable
from engine.async_engine import RequestStream
from kvtransfer import Peer
from node.completions import Prepared, respond, start
from node.responder import SSE_HEADERS, Responder, error_event
from node.state import NodeState
from protocol.kv_params import KVTransferParams
from protocol.openai import APIError

log = logging.getLogger("duet.decode")
#: P refused the release: the ids in kv_transfer_params are not that request's blocks
NOT_THEIRS = "the prefill node says these blocks do not belong to the request"


def _params(prep: Prepared, block_size: int) -> KVTransferParams:
    try:
        p = msgspec.convert(prep.body.kv_transfer_params, KVTransferParams)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid kv_transfer_params: {e}", param="kv_transfer_params") from None
    missing = [f for f in ("remote_engine_id", "remote_block_ids", "remote_request_id", "remote_host",
                           "remote_port") if getattr(p, f) is None]  # fmt: skip
    if missing:
        raise APIError(400, f"kv_transfer_params lacks {', '.join(missing)}", param="kv_transfer_params")
    n = len(prep.prompt_ids)
    if p.remote_num_tokens is not None and p.remote_num_tokens != n:
        raise APIError(400, f"the remote KV covers {p.remote_num_tokens} tokens but the prompt has {n}",
                       param="kv_transfer_params")  # fmt: skip
    need = -(-n // block_size)
    assert p.remote_block_ids is not None
    if len(p.remote_block_ids) != need:
        raise APIError(400, f"remote_block_ids has {len(p.remote_block_ids)} blocks but a {n}-token "
                            f"prompt needs {need} (block size {block_size})", param="kv_transfer_params")  # fmt: skip
    return p


async def decode_leg(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    if state.remote_kv is None:
        raise APIError(503, "this node has no KV transport; it cannot serve decode legs")
    cfg = state.config
    layout = state.engine.kv_layout
    p = _params(prep, layout.block_size)
    rid = prep.request_id
    responder = Responder(state, rid, rid, prep.arrival)
    failure: str | None = None
    peer: Peer | None = None
    try:
        peer = await state.remote_kv.peer(p.remote_engine_id, p.remote_host, p.remote_port)
        remote_blocks = peer.layout.num_blocks
        if any(not 0 <= b < remote_blocks for b in p.remote_block_ids):
            raise APIError(400, f"remote_block_ids {p.remote_block_ids} fall outside the prefill "
                                f"node's pool of {remote_blocks} blocks", param="kv_transfer_params")  # fmt: skip
    except PeerUnreachable as e:
        failure = str(e)
    state.enter(rid)
    try:
        try:
            stream = await start(state, rid, prep, prep.params, remote_num_tokens=len(prep.prompt_ids))
        except APIError:
            await _release_quietly(state, p)
            raise
        transfer = asyncio.ensure_future(_transfer(state, p, peer, stream, failure, responder))
        try:
            failure = await asyncio.shield(transfer)
        except asyncio.CancelledError:
            await responder.abort()  # the transfer task still tells the engine when it ends
            raise
        if failure == NOT_THEIRS:  # the client's kv_transfer_params were wrong: its error
            await responder.abort()
            raise APIError(400, f"remote_block_ids {p.remote_block_ids} do not belong to request "
                                f"{p.remote_request_id!r} on the prefill node", param="kv_transfer_params")  # fmt: skip
        if failure is not None and cfg.failure_policy == "fail":
            await responder.abort()
            err = APIError(502, f"KV transfer from the prefill node failed: {failure}",
                           type_="kv_transfer_error", code="kv_transfer_failed")  # fmt: skip
            if not prep.body.stream:
                raise err
            resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": rid})
            await resp.prepare(request)
            await resp.write(error_event(err))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        return await respond(state, request, prep, responder, stream)
    finally:
        state.leave(rid)


async def _transfer(state: NodeState, p: KVTransferParams, peer: Peer | None, stream: RequestStream,
                    failure: str | None, responder: Responder) -> str | None:  # fmt: skip
    """Steps 3-6. Returns None on success or the failure's reason. Always ends with kv_ready."""
    ok = False
    released = False
    try:
        assert stream.reserved is not None
        local = await stream.reserved
        t_reserved = time.monotonic()
        responder.timing["queue_s"] = t_reserved - responder.arrival
        if failure is None:
            k = stream.num_cached_blocks
            assert p.remote_block_ids is not None
            try:
                if k < len(local):
                    await state.transport.read(peer, p.remote_block_ids[k:], local[k:],
                                               timeout=state.config.transfer_timeout)  # fmt: skip
                status = await state.remote_kv.release(p.remote_host, p.remote_port, p.remote_request_id,
                                                       p.remote_block_ids)  # fmt: skip
                released = True
                if status == 400:
                    failure = NOT_THEIRS
                elif status == 404:
                    failure = "the prefill node's lease ran out before the pull finished"
                else:
                    ok = True
            except Exception as e:
                failure = f"{type(e).__name__}: {e}"
                state.remote_kv.forget(p.remote_engine_id)
        responder.timing["transfer_s"] = time.monotonic() - t_reserved
        if failure is not None:
            log.warning("KV pull failed (%s); policy %s", failure, state.config.failure_policy)
        else:
            log.info("pulled %d blocks in %.1f ms", len(local) - stream.num_cached_blocks,
                     (time.monotonic() - t_reserved) * 1e3)  # fmt: skip
        return failure
    finally:
        if not released:
            await _release_quietly(state, p)
        await state.engine.kv_ready(responder.engine_request_id, ok)


async def _release_quietly(state: NodeState, p: KVTransferParams) -> None:
    if p.remote_host and p.remote_port and p.remote_request_id:
        await state.remote_kv.release(p.remote_host, p.remote_port, p.remote_request_id, None)
