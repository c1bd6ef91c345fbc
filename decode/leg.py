"""The decode leg: pull the prompt's KV from the prefill node, then decode and stream.

Order (each step can fail with a defined answer, never a hang):
1. validate `kv_transfer_params`: fields present and well-typed, the address allowed by the
   PeerPolicy (403 without any connection otherwise), the block count consistent with the
   prompt; a 400 from here on releases P's blocks (when the ids are the request's: P checks),
   so a bad request does not pin them until the lease ends;
2. get the peer (cached metadata, or fetched from P; an engine id P does not run → 400);
3. reserve local blocks in the engine (WAITING_FOR_REMOTE_KV; a local prefix hit skips
   blocks), within `reserve_timeout` (else the request is aborted: 503 + Retry-After);
4. READ P's blocks with the transport, under a timeout;
5. release on P, checking the ids belong to the request: 200 → the bytes are good; 400 → the
   client's params were wrong (the request is aborted and the client gets a 400); anything
   else (404: the lease ran out, 5xx, unreachable) → the bytes may be stale → failed pull;
6. mark the KV ready (the engine recomputes the last prompt token for its logits), or on any
   failure apply the policy: `recompute` (prefill locally) or `fail` (an error to the client).
   A read that failed but may still write (the transport's `settled`) quarantines its blocks
   until the transport says it is over.
Steps 3-6 run in a task the client cannot cancel, and `kv_ready` runs whatever happens before
(a release that raises included): the engine must learn the transfer's end before it may free
blocks the transfer writes into.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from decode.remote_kv import PeerUnreachable, RemoteKV
from kvtransfer import Peer
from node.completions import Prepared, respond, start
from node.engine_api import EngineStream
from node.responder import SSE_HEADERS, Responder, end_stream, error_event
from node.state import NodeState
from protocol.kv_params import KVTransferParams
from protocol.openai import APIError

log = logging.getLogger("duet.decode")
#: P refused the release: the ids in kv_transfer_params are not that request's blocks
NOT_THEIRS = "the prefill node says these blocks do not belong to the request"
#: the engine did not reserve blocks for the remote KV in time
RESERVE_TIMEOUT = "no KV blocks could be reserved in time"
_RETRY_AFTER_S = "1"


@dataclass(frozen=True)
class Source:
    """Where the KV comes from, checked: an allowed address for this engine id."""

    engine_id: str
    host: str  # an IP address the policy allowed
    port: int
    request_id: str
    block_ids: list[int]


def remote_kv(state: NodeState) -> RemoteKV:
    rk = state.role_state.get("decode")
    if rk is None:
        raise APIError(503, "this node has no KV transport; it cannot serve decode legs")
    return rk  # type: ignore[no-any-return]


async def _source(rk: RemoteKV, p: KVTransferParams) -> Source:
    """Step 1a: the fields a contact needs, and the policy's word on the address."""
    missing = [f for f in ("remote_engine_id", "remote_block_ids", "remote_request_id", "remote_host",
                           "remote_port") if getattr(p, f) is None]  # fmt: skip
    if missing:
        raise APIError(400, f"kv_transfer_params lacks {', '.join(missing)}", param="kv_transfer_params")
    assert p.remote_engine_id is not None and p.remote_host is not None and p.remote_port is not None
    assert p.remote_request_id is not None and p.remote_block_ids is not None
    if not p.remote_engine_id or not p.remote_request_id:
        raise APIError(400, "remote_engine_id and remote_request_id must be non-empty", param="kv_transfer_params")
    if not 0 < p.remote_port < 65536:
        raise APIError(400, f"remote_port {p.remote_port} is not a TCP port", param="kv_transfer_params")
    addrs = await rk.policy.resolve(p.remote_host)
    if not addrs:
        raise APIError(400, f"remote_host {p.remote_host!r} does not resolve", param="kv_transfer_params")
    # Every address the name resolves to must be allowed; the one used must fit the engine's pin.
    reasons = [rk.policy.network_reason(a) for a in addrs[1:]]
    reasons.insert(0, rk.policy.allowed(addrs[0], p.remote_port, p.remote_engine_id))
    bad = next((r for r in reasons if r is not None), None)
    if bad is not None:
        status = 400 if "is at" in bad else 403
        raise APIError(status, f"refusing to contact the prefill node: {bad}", param="kv_transfer_params",
                       code="peer_not_allowed")  # fmt: skip
    return Source(p.remote_engine_id, addrs[0], p.remote_port, p.remote_request_id, list(p.remote_block_ids))


def _check_shape(src: Source, p: KVTransferParams, prep: Prepared, block_size: int) -> None:
    """Step 1b: the blocks match the prompt."""
    n = len(prep.prompt_ids)
    if p.remote_num_tokens is not None and p.remote_num_tokens != n:
        raise APIError(400, f"the remote KV covers {p.remote_num_tokens} tokens but the prompt has {n}",
                       param="kv_transfer_params")  # fmt: skip
    need = -(-n // block_size)
    if len(src.block_ids) != need:
        raise APIError(400, f"remote_block_ids has {len(src.block_ids)} blocks but a {n}-token "
                            f"prompt needs {need} (block size {block_size})", param="kv_transfer_params")  # fmt: skip
    if any(not 0 <= b < 2**31 for b in src.block_ids):
        raise APIError(400, "remote_block_ids must be block numbers (0 <= id < 2**31)", param="kv_transfer_params")


async def decode_leg(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    rk = remote_kv(state)
    cfg = state.config
    assert prep.kv_params is not None
    p = prep.kv_params
    src = await _source(rk, p)  # refused here: P is never contacted
    try:
        _check_shape(src, p, prep, state.engine.kv_layout.block_size)
    except APIError:
        await _release_quietly(rk, src)
        raise
    rid = prep.request_id
    responder = Responder(state, rid, rid, prep.arrival)
    failure: str | None = None
    peer: Peer | None = None
    try:
        peer = await rk.peer(src.engine_id, src.host, src.port)
        remote_blocks = peer.layout.num_blocks
        if any(b >= remote_blocks for b in src.block_ids):
            await _release_quietly(rk, src)
            raise APIError(400, f"remote_block_ids {src.block_ids} fall outside the prefill "
                                f"node's pool of {remote_blocks} blocks", param="kv_transfer_params")  # fmt: skip
    except PeerUnreachable as e:
        failure = str(e)
    state.enter(rid)
    try:
        try:
            stream = await start(state, rid, prep, prep.params, remote_num_tokens=len(prep.prompt_ids))
        except BaseException:
            await _release_quietly(rk, src)
            raise
        transfer = asyncio.ensure_future(_transfer(state, rk, src, peer, stream, failure, responder))
        try:
            failure = await asyncio.shield(transfer)
        except asyncio.CancelledError:
            await responder.abort()  # the transfer task still tells the engine when it ends
            raise
        if failure == RESERVE_TIMEOUT:  # the task aborted the engine request already
            state.metrics.rejected("reserve_timeout")
            raise _Unavailable(f"this node could not reserve KV blocks within {cfg.reserve_timeout:g} s; "
                               "retry later or on another node")  # fmt: skip
        if failure == NOT_THEIRS:  # the client's kv_transfer_params were wrong: its error
            await responder.abort()
            raise APIError(400, f"remote_block_ids {src.block_ids} do not belong to request "
                                f"{src.request_id!r} on the prefill node", param="kv_transfer_params")  # fmt: skip
        if failure is not None and cfg.failure_policy == "fail":
            await responder.abort()
            err = APIError(502, f"KV transfer from the prefill node failed: {failure}",
                           type_="kv_transfer_error", code="kv_transfer_failed")  # fmt: skip
            if not prep.body.stream:
                raise err
            resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": rid})
            await resp.prepare(request)
            await end_stream(resp, error_event(err))
            return resp
        return await respond(state, request, prep, responder, stream)
    finally:
        state.leave(rid)


class _Unavailable(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message, type_="service_unavailable", code="overloaded")
        self.headers = {"Retry-After": _RETRY_AFTER_S}


async def _transfer(state: NodeState, rk: RemoteKV, src: Source, peer: Peer | None, stream: EngineStream,
                    failure: str | None, responder: Responder) -> str | None:  # fmt: skip
    """Steps 3-6. Returns None on success or the failure's reason. Always ends with kv_ready."""
    ok = False
    released = False
    settled: Awaitable[Any] | None = None
    erid = responder.engine_request_id
    try:
        assert stream.reserved is not None
        try:
            local = await asyncio.wait_for(asyncio.shield(stream.reserved), state.config.reserve_timeout)
        except TimeoutError:
            # Abort before the kv_ready below: a reservation that lands in between is then
            # freed by it, instead of waiting for a kv_ready that already ran.
            with contextlib.suppress(Exception):
                await state.engine.abort(erid)
            return RESERVE_TIMEOUT
        except asyncio.CancelledError:
            if not stream.reserved.cancelled():
                raise  # this task was cancelled
            return "the request was aborted before its blocks were reserved"
        t_reserved = time.monotonic()
        responder.timing["queue_s"] = t_reserved - responder.arrival
        if failure is None:
            k = stream.num_cached_blocks
            try:
                if k < len(local):
                    await state.transport.read(peer, src.block_ids[k:], local[k:],
                                               timeout=state.config.transfer_timeout)  # fmt: skip
            except Exception as e:
                failure = f"{type(e).__name__}: {e}"
                settled = getattr(e, "settled", None)
                rk.forget(src.engine_id)
            else:
                released = True  # asked once, whatever the answer
                status = await rk.release(src.host, src.port, src.request_id, src.block_ids)
                if status == 200:
                    ok = True
                elif status == 400:
                    failure = NOT_THEIRS
                elif status == 404:
                    failure = "the prefill node's lease ran out before the pull finished"
                else:
                    failure = (f"the prefill node answered {status} to the release" if status
                               else "the prefill node could not be reached to release")  # fmt: skip
        responder.timing["transfer_s"] = time.monotonic() - t_reserved
        if failure is not None:
            log.warning("KV pull failed (%s); policy %s", failure, state.config.failure_policy)
        else:
            log.info("pulled %d blocks in %.1f ms", len(local) - stream.num_cached_blocks,
                     (time.monotonic() - t_reserved) * 1e3)  # fmt: skip
        return failure
    finally:
        try:
            if not released:
                await _release_quietly(rk, src)
        finally:
            with contextlib.suppress(Exception):
                await state.engine.kv_ready(erid, ok, quarantine=settled is not None)
            if settled is not None:
                _unquarantine_later(state, erid, settled)


def _unquarantine_later(state: NodeState, erid: str, settled: Awaitable[Any]) -> None:
    async def run() -> None:
        with contextlib.suppress(Exception):
            await settled
        n = await state.engine.release_quarantine(erid)
        log.info("the failed transfer of %s is over: %d quarantined blocks freed", erid, n)

    task = asyncio.ensure_future(run())
    tasks: set[asyncio.Task[None]] = state.role_state.setdefault("decode_quarantine", set())
    tasks.add(task)  # strong reference until done
    task.add_done_callback(tasks.discard)


async def _release_quietly(rk: RemoteKV, src: Source) -> None:
    """Let P free the blocks now instead of at its lease's end. The block ids go along: P frees
    only when they are exactly the request's, so a client cannot free others' blocks by naming
    their request id."""
    with contextlib.suppress(Exception):
        await rk.release(src.host, src.port, src.request_id, src.block_ids)
