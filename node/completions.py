"""`POST /v1/completions` on a node: parse and validate, then one of three legs —
local (prefill and decode here), prefill leg (`do_remote_decode`: compute the prompt's KV and
hold it for a decode node) or decode leg (`do_remote_prefill`: pull the KV from the prefill
node named in `kv_transfer_params`, then decode).

Engine request ids: a prefill leg runs as "prefill:<X-Request-Id>", everything else as the
X-Request-Id itself, so a colocated node can serve both legs of one request.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from engine.async_engine import RequestStream
from engine.core import RequestError
from engine.request import Priority
from engine.sampling_params import SamplingParams
from node.request_log import REQUEST_ID
from node.responder import Responder
from node.state import NodeState
from protocol.openai import APIError, CompletionRequest

log = logging.getLogger("duet.node")
_DEC = msgspec.json.Decoder(CompletionRequest)


def prefill_request_id(request_id: str) -> str:
    return f"prefill:{request_id}"


def parse_body(raw: bytes) -> CompletionRequest:
    try:
        body = _DEC.decode(raw)
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed request body: {e}") from None
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}") from None
    body.validate()
    return body


def sampling_params(body: CompletionRequest, max_tokens: int | None = None) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens or body.max_tokens or 16,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            skip_special_tokens=body.skip_special_tokens,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


@dataclass
class Prepared:
    """A validated request, ready for a leg."""

    request_id: str
    body: CompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    priority: Priority
    arrival: float


def prepare(state: NodeState, raw: bytes) -> Prepared:
    arrival = time.monotonic()
    body = parse_body(raw)
    engine = state.engine
    if body.model and body.model != engine.model_name:
        raise APIError(404, f"model {body.model!r} is not served here (this node serves "
                            f"{engine.model_name!r})", code="model_not_found", param="model")  # fmt: skip
    prompt = body.single_prompt()
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    params = sampling_params(body)
    if len(ids) + params.max_tokens > engine.max_model_len:
        raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, "
                            f"but {len(ids) + params.max_tokens} were requested ({len(ids)} in the "
                            f"prompt, {params.max_tokens} for the completion)",
                       param="max_tokens", code="context_length_exceeded")  # fmt: skip
    priority = Priority.BATCH if body.priority == "batch" else Priority.INTERACTIVE
    rid = REQUEST_ID.get()
    return Prepared(request_id=rid, body=body, prompt_ids=ids, params=params, priority=priority,
                    arrival=arrival)


async def handle_completions(state: NodeState, request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    prep = prepare(state, raw)
    ktp = prep.body.kv_transfer_params or {}
    role = state.config.role
    if ktp.get("do_remote_decode"):
        if role == "decode":
            raise APIError(400, "this is a decode node: it does not run prefill legs")
        from prefill.leg import prefill_leg

        return await prefill_leg(state, request, prep)
    if ktp.get("do_remote_prefill"):
        if role == "prefill":
            raise APIError(400, "this is a prefill node: it does not run decode legs")
        from decode.leg import decode_leg

        return await decode_leg(state, request, prep)
    return await local_leg(state, request, prep)


async def start(state: NodeState, engine_request_id: str, prep: Prepared, params: SamplingParams,
                **hooks: Any) -> RequestStream:  # fmt: skip
    """Queue the request in the engine; a request the engine refuses is the client's 400."""
    try:
        return await state.engine.add_request(engine_request_id, prep.prompt_ids, params,
                                              prep.priority, **hooks)  # fmt: skip
    except RequestError as e:
        raise APIError(400, str(e)) from None


async def local_leg(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    rid = prep.request_id
    state.enter(rid)
    try:
        stream = await start(state, rid, prep, prep.params)
        return await respond(state, request, prep, Responder(state, rid, rid, prep.arrival), stream)
    finally:
        state.leave(rid)


async def respond(state: NodeState, request: web.Request, prep: Prepared, responder: Responder,
                  stream: RequestStream) -> web.StreamResponse:
    model = state.engine.model_name
    if prep.body.stream:
        return await responder.stream(request, stream, model)
    result = await responder.collect(stream, model)
    return web.Response(body=msgspec.json.encode(result), content_type="application/json",
                        headers={"X-Request-Id": prep.request_id})  # fmt: skip


def new_request_id() -> str:
    """For requests that arrive without an X-Request-Id."""
    return f"cmpl-{uuid.uuid4().hex}"
