"""The prefill and decode legs of a node whose engine moves KV itself (`handles_kv_transfer`:
vLLM and its NixlConnector), registered by the composition root instead of prefill/ and decode/.

The gateway drives these legs exactly as it drives native ones (DESIGN §1, issue #14):
- prefill leg (`do_remote_decode`): the prompt with max_tokens=1 and
  `kv_transfer_params={"do_remote_decode": true}` into the engine; the answer carries the
  engine's params (`do_remote_prefill`, `remote_engine_id`, `remote_block_ids`,
  `remote_request_id`, `remote_host`, `remote_port`, ...), unchanged. The engine holds the blocks
  under its own lease (`--lease-seconds`); `/abort` drops the request.
- decode leg (`do_remote_prefill`): the client's params, checked field by field
  (`VllmRemoteParams`: only vLLM's fields, well typed), and the address checked against
  `--allowed-peers` before the engine may contact it (a name must resolve inside the allowed
  networks; the engine is handed the address, not the name); then the engine pulls, decodes and
  streams. A failed pull is the engine's `kv_load_failure_policy` (`--failure-policy`):
  recompute locally, or fail the request (an error answer / SSE error event).

Nothing here is vLLM-specific code: only the interface (`handles_kv_transfer`, the
`kv_transfer_params` of `add_request` and of the finishing `Delta`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from typing import Any

import msgspec
from aiohttp import web

from node.completions import Prepared, answer, prefill_request_id, respond
from node.config import parse_networks
from node.engine_api import EngineStream, RequestRefused
from node.legs import Roles
from node.responder import Responder
from node.state import NodeState
from protocol.openai import APIError

log = logging.getLogger("duet.node")
_RESOLVE_TIMEOUT_S = 2.0
_PARAM = "kv_transfer_params"


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


def _engine_handles_kv(state: NodeState) -> None:
    if not getattr(state.engine, "handles_kv_transfer", False):
        raise APIError(503, "this node's engine does not move KV itself; it cannot serve this leg")


async def _start(state: NodeState, erid: str, prep: Prepared, kv: dict[str, Any]) -> EngineStream:
    try:
        return await state.engine.add_request(erid, prep.prompt_ids, prep.params, prep.priority,
                                              kv_transfer_params=kv)  # fmt: skip
    except RequestRefused as e:
        raise APIError(400, str(e)) from None


async def prefill_leg(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    _engine_handles_kv(state)
    if prep.body.stream:
        raise APIError(400, "a prefill leg (do_remote_decode) cannot stream", param="stream")
    extra = set(prep.body.kv_transfer_params or {}) - {"do_remote_decode"}
    if extra:
        raise APIError(400, f"a prefill leg takes only do_remote_decode, not {sorted(extra)}", param=_PARAM)
    erid = prefill_request_id(prep.request_id)
    prep.params.max_tokens = 1  # P computes the prompt; the first real token comes from D
    state.enter(erid)
    try:
        stream = await _start(state, erid, prep, {"do_remote_decode": True})
        result = await Responder(state, prep.request_id, erid, prep.arrival).collect(stream, state.engine.model_name)
    finally:
        state.leave(erid)
    if not result.kv_transfer_params or not result.kv_transfer_params.get("do_remote_prefill"):
        raise APIError(500, "the engine finished the prefill without handing its KV over", type_="internal_error")
    log.info("prefilled %d tokens for a remote decode", len(prep.prompt_ids))
    return answer(prep, result)


async def _allowed_address(state: NodeState, host: str) -> str:
    """The one address the engine may contact for `host`, or a 403 (never a connection)."""
    networks = parse_networks(state.config.allowed_peers)
    try:
        addrs = [str(ipaddress.ip_address(host))]
    except ValueError:
        if not host or len(host) > 253:
            raise APIError(400, "remote_host is empty or too long", param=_PARAM) from None
        try:
            infos = await asyncio.wait_for(asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM),
                                           _RESOLVE_TIMEOUT_S)  # fmt: skip
        except (OSError, TimeoutError, UnicodeError):
            raise APIError(400, f"remote_host {host!r} does not resolve", param=_PARAM) from None
        addrs = sorted({str(i[4][0]) for i in infos})
    bad = [a for a in addrs if not any(ipaddress.ip_address(a) in n for n in networks)]
    if bad or not addrs:
        raise APIError(403, f"remote_host {host} is outside this node's allowed peer networks",
                       code="peer_not_allowed", param=_PARAM)  # fmt: skip
    return addrs[0]


def _flat(ids: list[int | list[int]]) -> list[int]:
    return [x for b in ids for x in (b if isinstance(b, list) else [b])]


async def decode_leg(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    _engine_handles_kv(state)
    try:
        p = msgspec.convert(prep.body.kv_transfer_params, VllmRemoteParams)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid kv_transfer_params: {e}", param=_PARAM) from None
    ids = p.remote_block_ids
    if not (all(isinstance(b, int) for b in ids) or all(isinstance(b, list) for b in ids)):
        raise APIError(400, "remote_block_ids must be block ids or lists of block ids, not a mix", param=_PARAM)
    if any(b < 0 for b in _flat(ids)):
        raise APIError(400, "remote_block_ids must be non-negative", param=_PARAM)
    if not 0 < p.remote_port < 65536:
        raise APIError(400, f"remote_port {p.remote_port} is not a TCP port", param=_PARAM)
    if not p.remote_engine_id or not p.remote_request_id:
        raise APIError(400, "remote_engine_id and remote_request_id must be non-empty", param=_PARAM)
    if p.remote_num_tokens is not None and not 0 <= p.remote_num_tokens <= len(prep.prompt_ids):
        raise APIError(400, f"remote_num_tokens {p.remote_num_tokens} exceeds the prompt's "
                            f"{len(prep.prompt_ids)} tokens", param=_PARAM)  # fmt: skip
    address = await _allowed_address(state, p.remote_host)
    kv = msgspec.structs.asdict(p)
    kv["remote_host"] = address
    kv.pop("lease_seconds")
    kv = {k: v for k, v in kv.items() if v is not None}
    rid = prep.request_id
    state.enter(rid)
    try:
        stream = await _start(state, rid, prep, kv)
        return await respond(state, request, prep, Responder(state, rid, rid, prep.arrival), stream)
    finally:
        state.leave(rid)


async def abort_prefill(state: NodeState, request_id: str) -> bool:
    """`POST /abort`: drop the prefill leg of `request_id`."""
    return await state.engine.abort(prefill_request_id(request_id))


def register_prefill(roles: Roles) -> None:
    roles.add_role("prefill")
    roles.add_leg("do_remote_decode", prefill_leg)
    roles.on_abort.append(abort_prefill)


def register_decode(roles: Roles) -> None:
    roles.add_role("decode")
    roles.add_leg("do_remote_prefill", decode_leg)
