"""The prefill and decode legs of a node whose engine moves KV itself (`handles_kv_transfer`:
vLLM and its NixlConnector), registered by the composition root instead of prefill/ and decode/.

The gateway drives these legs exactly as it drives native ones (DESIGN §1):
- prefill leg (`do_remote_decode`): the prompt with max_tokens=1 and
  `kv_transfer_params={"do_remote_decode": true}` into the engine; the answer carries the
  engine's params (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`,
  `remote_request_id`, `remote_host`, `remote_port`, ...), unchanged. The engine holds the blocks
  under its own lease (`--lease-s`); `/abort` drops the request.
- decode leg (`do_remote_prefill`): the client's params, checked field by field
  (`VllmRemoteParams`: only vLLM's fields, well typed), and the address checked against
  `--allowed-peers` before the engine may contact it (a name must resolve inside the allowed
  networks; the engine is handed the address, not the name), and with a cluster the host of a
  registered prefill-capable node (an unregistered "prefill" poisons no cache), and on this
  host unless the KV network is stated isolated (node/kv_network.py); then the engine pulls,
  decodes and streams. A failed pull is the engine's `kv_load_failure_policy`
  (`--failure-policy`): recompute locally, or fail the request (an error answer / SSE error event).

Nothing here is vLLM-specific code: only the role API (node.legs) and the engine interface
(`handles_kv_transfer`, the typed `kv_transfer_params` of `add_request` and of the finishing
`Delta`; node.engines.vllm_sampling turns them into vLLM's dict and back).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket

import msgspec
from aiohttp import web

from node import kv_network
from node.engine_api import KVHandoff
from node.legs import DECODE_TRIGGER, PREFILL_TRIGGER, LegContext, Node, Roles, prefill_request_id
from protocol.kv_params import KVTransferParams
from protocol.openai import APIError

log = logging.getLogger("duet.node")
_RESOLVE_TIMEOUT_S = 2.0
_PARAM = "kv_transfer_params"
_READ = "read KV from"


class VllmRemoteParams(msgspec.Struct, kw_only=True, frozen=True):
    """What a decode leg passes on: the fields vLLM's NixlConnector answers a prefill with (any
    other field is dropped, never handed to the engine)."""

    do_remote_prefill: bool
    do_remote_decode: bool = False
    remote_engine_id: str
    #: block ids, or one list of them per KV cache group (vLLM's BlockIds)
    remote_block_ids: list[int | list[int]]
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_num_tokens: int | None = None
    tp_size: int = 1
    dcp_size: int | None = None
    pp_size: int | None = None
    remote_blocks_expiry_time: float | None = None
    transfer_mode: str | None = None
    remote_prefill_cached_tokens: int | None = None
    #: duet's own, ignored by vLLM
    lease_seconds: float | None = None


def _engine_handles_kv(node: Node) -> None:
    if not getattr(node.engine, "handles_kv_transfer", False):
        raise APIError(503, "this node's engine does not move KV itself; it cannot serve this leg")


async def prefill_leg(leg: LegContext) -> web.StreamResponse:
    prep = leg.prep
    _engine_handles_kv(leg.node)
    if prep.body.stream:
        raise APIError(400, "a prefill leg (do_remote_decode) cannot stream", param="stream")
    extra = set(msgspec.to_builtins(prep.kv_params or KVTransferParams())) - {"do_remote_decode"}
    if extra:
        raise APIError(
            400, f"a prefill leg takes only do_remote_decode, not {sorted(extra)}", param=_PARAM
        )
    prep.params.max_tokens = 1  # P computes the prompt; the first real token comes from D
    stream = await leg.start(
        prep.params, KVHandoff(kv_transfer_params=KVTransferParams(do_remote_decode=True))
    )
    result = await leg.collect(stream)
    if result.kv_transfer_params is None or not result.kv_transfer_params.do_remote_prefill:
        raise APIError(
            500,
            "the engine finished the prefill without handing its KV over",
            type_="internal_error",
        )
    log.info("prefilled %d tokens for a remote decode", len(prep.prompt_ids))
    return leg.answer(result)


async def _resolve(host: str) -> list[str]:
    """The IP addresses of `host` (itself when it is one); a 400 when it does not resolve."""
    try:
        return [str(ipaddress.ip_address(host))]
    except ValueError:
        if not host or len(host) > 253:
            raise APIError(400, "remote_host is empty or too long", param=_PARAM) from None
    try:
        async with asyncio.timeout(_RESOLVE_TIMEOUT_S):
            loop = asyncio.get_running_loop()
            infos = await loop.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError):
        raise APIError(400, f"remote_host {host!r} does not resolve", param=_PARAM) from None
    return sorted({str(i[4][0]) for i in infos})


async def _allowed_address(node: Node, host: str) -> str:
    """The one address the engine may contact for `host`, or a 403 (never a connection): inside
    the allowed networks and, on a node with a cluster, the host of a registered prefill-capable
    node (vLLM's engine ids and side-channel ports are its own, so the host is what is checked)."""
    networks = node.config.peer_networks()
    addrs = await _resolve(host)
    bad = [a for a in addrs if not any(ipaddress.ip_address(a) in n for n in networks)]
    if bad or not addrs:
        raise APIError(
            403,
            f"remote_host {host} is outside this node's allowed peer networks",
            code="peer_not_allowed",
            param=_PARAM,
        )
    if why := kv_network.refusal(addrs[0], node.config.kv_network_isolated, "nixl", _READ):
        log.warning("decode leg: %s", why)  # vLLM's NixlConnector moves the KV
        raise APIError(403, why, code=kv_network.CODE, param=_PARAM)
    members = node.members
    if members is not None:
        if not members.listed:
            raise APIError(
                503,
                "this node has not read the cluster's registrations yet; retry shortly",
                type_="service_unavailable",
                code="overloaded",
            )
        registered = {a for h in members.kv_hosts() for a in await _resolve_quietly(h)}
        if addrs[0] not in registered:
            raise APIError(
                403,
                f"remote_host {host} is no registered prefill node of this cluster",
                code="peer_not_allowed",
                param=_PARAM,
            )
    return addrs[0]


async def _resolve_quietly(host: str) -> list[str]:
    try:
        return await _resolve(host)
    except APIError:
        return []


def _flat(ids: list[int | list[int]]) -> list[int]:
    return [x for b in ids for x in (b if isinstance(b, list) else [b])]


def _remote_params(kv: KVTransferParams | None, num_prompt_tokens: int) -> VllmRemoteParams:
    """The decode leg's params, checked field by field as vLLM's connector needs them."""
    try:
        p = msgspec.convert(msgspec.to_builtins(kv or KVTransferParams()), VllmRemoteParams)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid kv_transfer_params: {e}", param=_PARAM) from None
    ids = p.remote_block_ids
    if not (all(isinstance(b, int) for b in ids) or all(isinstance(b, list) for b in ids)):
        raise APIError(
            400, "remote_block_ids must be block ids or lists of block ids, not a mix", param=_PARAM
        )
    if any(b < 0 for b in _flat(ids)):
        raise APIError(400, "remote_block_ids must be non-negative", param=_PARAM)
    if not 0 < p.remote_port < 65536:
        raise APIError(400, f"remote_port {p.remote_port} is not a TCP port", param=_PARAM)
    if not p.remote_engine_id or not p.remote_request_id:
        raise APIError(
            400, "remote_engine_id and remote_request_id must be non-empty", param=_PARAM
        )
    if p.remote_num_tokens is not None and not 0 <= p.remote_num_tokens <= num_prompt_tokens:
        raise APIError(
            400,
            f"remote_num_tokens {p.remote_num_tokens} exceeds the prompt's "
            f"{num_prompt_tokens} tokens",
            param=_PARAM,
        )
    return p


async def decode_leg(leg: LegContext) -> web.StreamResponse:
    _engine_handles_kv(leg.node)
    p = _remote_params(leg.prep.kv_params, len(leg.prep.prompt_ids))
    address = await _allowed_address(leg.node, p.remote_host)
    # vLLM's fields only, the address the policy allowed in place of the name; duet's lease
    # is not vLLM's
    kv = msgspec.convert(
        {**msgspec.to_builtins(p), "remote_host": address, "lease_seconds": None}, KVTransferParams
    )
    return await leg.respond(await leg.start(leg.prep.params, KVHandoff(kv_transfer_params=kv)))


async def abort_prefill(node: Node, request_id: str) -> bool:
    """`POST /abort`: drop the prefill leg of `request_id`."""
    return await node.engine.abort(prefill_request_id(request_id))


def register_prefill(roles: Roles) -> None:
    roles.add_role("prefill")
    roles.add_leg(PREFILL_TRIGGER, prefill_leg)
    roles.on_abort.append(abort_prefill)


def register_decode(roles: Roles) -> None:
    roles.add_role("decode")
    roles.add_leg(DECODE_TRIGGER, decode_leg)
