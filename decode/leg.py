"""The decode leg: pull the prompt's KV from the prefill node, then decode and stream.

Order (each step can fail with a defined answer, never a hang):
1. validate `kv_transfer_params`: fields present and well-typed, the address allowed by the
   PeerPolicy (403 without any connection otherwise), the block count consistent with the
   prompt; a 400 from here on releases P's blocks (when the ids are the request's: P checks),
   so a bad request does not pin them until the lease ends; a guided leg takes P's sampled
   token (`first_token_id`) as its output's first, and the engine refuses it (400) unless the
   grammar allows it after the tokens so far (a migrated leg's `resume` tokens), so D's matcher
   continues from P's token; an unguided leg samples its first token itself. On a node with
   a cluster, an engine this node does not see registered as a prefill-capable node at that
   address is never contacted (nor released): the leg goes on as after a failed pull
   (`NOT_A_MEMBER`), so the prompt is prefilled here (or a 502 under `fail`). This node's
   view of etcd can lag the coordinator's that chose P (an etcd member cut off): the client's
   request is not the one at fault;
2. get the peer (cached metadata, or fetched from P; an engine id P does not run → 400; a
   transport address in P's metadata outside the allowed networks or off the named host →
   403, before the transport connects);
3. reserve local blocks in the engine (WAITING_FOR_REMOTE_KV; a local prefix hit skips
   blocks), within `reserve_timeout_s` (else the request is aborted: 503 + Retry-After);
4. READ P's blocks with the transport, under a timeout; the engine checks them against P's
   content digests (`remote_block_digests`) before they count: a mismatch is a failed pull;
5. release on P, checking the ids belong to the request: 200 → the bytes are good; 400 → the
   client's params were wrong (the request is aborted and the client gets a 400); anything
   else (404: the lease ran out, 5xx, unreachable) → the bytes may be stale → failed pull;
6. mark the KV ready (the engine recomputes the last prompt token for its logits), or on any
   failure apply the policy: `recompute` (prefill locally) or `fail` (an error to the client).
   A read that failed but may still write (the transport's `settled`) quarantines its blocks
   until the transport says it is over.
Steps 3-6 (decode.pull) run in a task the client cannot cancel, and `kv_ready` runs whatever
happens before (a release that raises included): the engine must learn the transfer's end
before it may free blocks the transfer writes into. Their outcome is a `PullOutcome`, and the
answer is chosen by matching on it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from aiohttp import web

from decode.pull import Pull, Puller, PullOutcome, Source, release_quietly
from kvtransfer import Peer
from node.engine_api import EngineStream, KVHandoff, SamplingParams
from node.legs import LegContext, Membership, Node, PeerUnreachable, Prepared, RemoteKV
from protocol.kv_params import KVTransferParams
from protocol.openai import APIError

log = logging.getLogger("duet.decode")
_RETRY_AFTER_S = "1"


def remote_kv(node: Node) -> RemoteKV:
    rk = node.remote_kv
    if rk is None:
        raise APIError(503, "this node has no KV transport; it cannot serve decode legs")
    return rk


async def _source(
    rk: RemoteKV, p: KVTransferParams, members: Membership | None
) -> tuple[Source, str | None]:
    """Step 1a: the fields a contact needs, the policy's word on the address, and with a
    cluster, whether the engine is a registered prefill-capable node at that address (why not,
    or None)."""
    missing = [
        f
        for f in (
            "remote_engine_id",
            "remote_block_ids",
            "remote_request_id",
            "remote_host",
            "remote_port",
        )
        if getattr(p, f) is None
    ]
    if missing:
        raise APIError(
            400, f"kv_transfer_params lacks {', '.join(missing)}", param="kv_transfer_params"
        )
    assert (
        p.remote_engine_id is not None and p.remote_host is not None and p.remote_port is not None
    )
    assert p.remote_request_id is not None and p.remote_block_ids is not None
    if not all(isinstance(b, int) for b in p.remote_block_ids):
        raise APIError(400, "remote_block_ids must be block numbers", param="kv_transfer_params")
    if not p.remote_engine_id or not p.remote_request_id:
        raise APIError(
            400,
            "remote_engine_id and remote_request_id must be non-empty",
            param="kv_transfer_params",
        )
    if not 0 < p.remote_port < 65536:
        raise APIError(
            400, f"remote_port {p.remote_port} is not a TCP port", param="kv_transfer_params"
        )
    addrs = await rk.policy.resolve(p.remote_host)
    if not addrs:
        raise APIError(
            400, f"remote_host {p.remote_host!r} does not resolve", param="kv_transfer_params"
        )
    # Every address the name resolves to must be allowed; the one used must fit the engine's pin.
    reasons = [rk.policy.network_reason(a) for a in addrs[1:]]
    reasons.insert(0, rk.policy.allowed(addrs[0], p.remote_port, p.remote_engine_id))
    bad = next((r for r in reasons if r is not None), None)
    if bad is not None:
        status = 400 if "is at" in bad else 403
        raise APIError(
            status,
            f"refusing to contact the prefill node: {bad}",
            param="kv_transfer_params",
            code="peer_not_allowed",
        )
    refused = None
    if members is not None:
        refused = await _registered(rk, members, p.remote_engine_id, addrs, p.remote_port)
    src = Source(
        p.remote_engine_id,
        addrs[0],
        p.remote_port,
        p.remote_request_id,
        [b for b in p.remote_block_ids if isinstance(b, int)],
        tuple(addrs),
        p.remote_block_digests,
        p.remote_host,
    )
    return src, refused


async def _registered(
    rk: RemoteKV, members: Membership, engine_id: str, addrs: list[str], port: int
) -> str | None:
    """With a cluster, only its registered prefill-capable nodes are pulled from, at the address
    they registered (node.members): why this one is not, or None."""
    if not members.listed:
        raise _Unavailable("this node has not read the cluster's registrations yet; retry shortly")
    where = members.kv_source(engine_id)
    if where is None:
        reason = f"engine {engine_id!r} is not a registered prefill node of this cluster"
    elif where[1] != port or not set(await rk.policy.resolve(where[0])) & set(addrs):
        reason = (
            f"engine {engine_id!r} is registered at {where[0]}:{where[1]}, not {addrs[0]}:{port}"
        )
    else:
        return None
    return f"refusing to contact the prefill node: {reason}"


def _check_shape(src: Source, p: KVTransferParams, prep: Prepared, block_size: int) -> None:
    """Step 1b: the blocks match the prompt."""
    n = len(prep.prompt_ids)
    if p.remote_num_tokens is not None and p.remote_num_tokens != n:
        raise APIError(
            400,
            f"the remote KV covers {p.remote_num_tokens} tokens but the prompt has {n}",
            param="kv_transfer_params",
        )
    need = -(-n // block_size)
    if len(src.block_ids) != need:
        raise APIError(
            400,
            f"remote_block_ids has {len(src.block_ids)} blocks but a {n}-token "
            f"prompt needs {need} (block size {block_size})",
            param="kv_transfer_params",
        )
    if any(not 0 <= b < 2**31 for b in src.block_ids):
        raise APIError(
            400,
            "remote_block_ids must be block numbers (0 <= id < 2**31)",
            param="kv_transfer_params",
        )
    digests = src.digests
    if digests is not None and (
        len(digests) != len(src.block_ids) or any(not 0 <= d < 2**64 for d in digests)
    ):
        raise APIError(
            400,
            "remote_block_digests must hold one unsigned 64-bit digest per remote block",
            param="kv_transfer_params",
        )


def _params(p: KVTransferParams, prep: Prepared) -> SamplingParams:
    """Step 1c: the engine's params, with P's first token on a guided leg (the engine checks
    the guide allows it: a 400 when it does not)."""
    if p.first_token_id is None:
        return prep.params
    try:
        return replace(prep.params, first_token=p.first_token_id)
    except ValueError as e:
        raise APIError(
            400, f"kv_transfer_params.first_token_id: {e}", param="kv_transfer_params"
        ) from None


async def decode_leg(leg: LegContext) -> web.StreamResponse:
    rk = remote_kv(leg.node)
    p, prep = leg.prep.kv_params, leg.prep
    assert p is not None
    src, refused = await _source(rk, p, leg.node.members)  # refused: P is never contacted
    release = _no_release if refused is not None else release_quietly
    try:
        _check_shape(src, p, prep, leg.node.engine.kv_layout.block_size)
        params = _params(p, prep)
    except APIError:
        await release(rk, src)
        raise
    peer: Peer | None
    failure: Pull | None
    if refused is not None:
        log.warning("%s; the prompt is prefilled here instead", refused)
        peer, failure = None, Pull(PullOutcome.NOT_A_MEMBER, refused)
    else:
        peer, failure = await _connect(rk, src)
    try:
        stream = await leg.start(params, KVHandoff(remote_num_tokens=len(prep.prompt_ids)))
    except BaseException:
        await release(rk, src)
        raise
    puller = Puller(leg, rk, src, stream)
    puller.released = refused is not None  # a node this one does not know is not asked
    transfer = asyncio.ensure_future(puller.run(peer, failure))
    try:
        pull = await asyncio.shield(transfer)
    except asyncio.CancelledError:
        await leg.abort()  # the transfer task still tells the engine when it ends
        raise
    return await _answer(leg, src, pull, stream)


async def _no_release(rk: RemoteKV, src: Source) -> None:
    """A source that is not a member is not contacted, not even to free its blocks (its lease
    frees them)."""


async def _connect(rk: RemoteKV, src: Source) -> tuple[Peer | None, Pull | None]:
    """Step 2: the peer, or the pull's failure when P cannot be reached (the blocks are still
    reserved and handed back, so the failure policy applies as after a failed READ)."""
    try:
        peer = await rk.peer(src.engine_id, src.host, src.port, src.addresses, src.name)
    except PeerUnreachable as e:
        return None, Pull(PullOutcome.PEER_UNREACHABLE, str(e))
    remote_blocks = peer.layout.num_blocks
    if any(b >= remote_blocks for b in src.block_ids):
        await release_quietly(rk, src)
        raise APIError(
            400,
            f"remote_block_ids {src.block_ids} fall outside the prefill "
            f"node's pool of {remote_blocks} blocks",
            param="kv_transfer_params",
        )
    return peer, None


async def _answer(
    leg: LegContext, src: Source, pull: Pull, stream: EngineStream
) -> web.StreamResponse:
    cfg = leg.node.config
    match pull.outcome:
        case PullOutcome.OK:
            return await leg.respond(stream)
        case PullOutcome.RESERVE_TIMEOUT:  # the puller aborted the engine request already
            leg.node.metrics.rejected("reserve_timeout")
            raise _Unavailable(
                f"this node could not reserve KV blocks within {cfg.reserve_timeout_s:g} s; "
                "retry later or on another node"
            )
        case PullOutcome.NOT_THEIRS:  # the client's kv_transfer_params were wrong: its error
            await leg.abort()
            raise APIError(
                400,
                f"remote_block_ids {src.block_ids} do not belong to request "
                f"{src.request_id!r} on the prefill node",
                param="kv_transfer_params",
            )
        case _ if cfg.failure_policy == "fail":
            await leg.abort()
            err = APIError(
                502,
                f"KV transfer from the prefill node failed: {pull.detail}",
                type_="kv_transfer_error",
                code="kv_transfer_failed",
            )
            if not leg.prep.body.stream:
                raise err
            return await leg.stream_error(err)
        case _:  # policy recompute: the engine prefills the prompt here
            return await leg.respond(stream)


class _Unavailable(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(503, message, type_="service_unavailable", code="overloaded")
        self.headers = {"Retry-After": _RETRY_AFTER_S}
