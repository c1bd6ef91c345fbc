"""`POST /v1/completions` (and its chat form, node/chat.py) on a node: parse and validate, then one of the legs — local (prefill
and decode here) or a leg a role registered for the `kv_transfer_params` trigger it carries
(node.legs: `do_remote_decode` → prefill leg, `do_remote_prefill` → decode leg).

Engine request ids: a prefill leg runs as "prefill:<X-Request-Id>", everything else as the
X-Request-Id itself, so a colocated node can serve both legs of one request.

Nothing here trusts the body: every field is type-checked (msgspec: no bool for an int, no
unknown kv_transfer_params shapes), range-checked (SamplingParams, the context length), and
string prompts are tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import msgspec
from aiohttp import web

from node.chat import ChatChunker, as_completion, chat_response, parse_chat, template
from node.engine_api import EngineStream, RequestRefused
from node.request_log import REQUEST_ID
from node.responder import Responder
from node.state import NodeState
from protocol.kv_params import KVTransferParams
from protocol.openai import APIError, CompletionRequest, CompletionResponse, decode_body
from protocol.sampling import Priority, SamplingParams

log = logging.getLogger("duet.node")
_DEC = msgspec.json.Decoder(CompletionRequest)


def prefill_request_id(request_id: str) -> str:
    return f"prefill:{request_id}"


def parse_body(raw: bytes) -> CompletionRequest:
    body = decode_body(_DEC, raw)
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
            logprobs=body.logprobs,
            prompt_logprobs=body.prompt_logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def transfer_params(body: CompletionRequest) -> KVTransferParams | None:
    if body.kv_transfer_params is None:
        return None
    try:
        p = msgspec.convert(body.kv_transfer_params, KVTransferParams)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid kv_transfer_params: {e}", param="kv_transfer_params") from None
    if p.do_remote_decode and p.do_remote_prefill:
        raise APIError(400, "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill",
                       param="kv_transfer_params")  # fmt: skip
    return p


@dataclass
class Prepared:
    """A validated request, ready for a leg."""

    request_id: str
    body: CompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    priority: Priority
    arrival: float
    kv_params: KVTransferParams | None = None
    #: answer in the chat shape (the request came to /v1/chat/completions)
    chat: bool = False


async def prepare(state: NodeState, raw: bytes) -> Prepared:
    arrival = time.monotonic()
    return await prepare_body(state, parse_body(raw), arrival)


async def prepare_body(state: NodeState, body: CompletionRequest, arrival: float, chat: bool = False) -> Prepared:
    engine = state.engine
    if body.model and body.model != engine.model_name:
        raise APIError(404, f"model {body.model!r} is not served here (this node serves "
                            f"{engine.model_name!r})", code="model_not_found", param="model")  # fmt: skip
    # An engine that moves KV itself (vLLM) gets the params as sent; its legs check them.
    kv_params = None if getattr(engine, "handles_kv_transfer", False) else transfer_params(body)
    params = sampling_params(body)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        # Tokenizing a long prompt takes milliseconds: never on the event loop.
        ids = await asyncio.to_thread(engine.tokenizer.encode, prompt)
    else:
        ids = list(prompt)
    if len(ids) + params.max_tokens > engine.max_model_len:
        raise APIError(400, f"this model's maximum context length is {engine.max_model_len} tokens, "
                            f"but {len(ids) + params.max_tokens} were requested ({len(ids)} in the "
                            f"prompt, {params.max_tokens} for the completion)",
                       param="max_tokens", code="context_length_exceeded")  # fmt: skip
    priority = Priority.BATCH if body.priority == "batch" else Priority.INTERACTIVE
    rid = REQUEST_ID.get()
    return Prepared(request_id=rid, body=body, prompt_ids=ids, params=params, priority=priority,
                    arrival=arrival, kv_params=kv_params, chat=chat)  # fmt: skip


async def handle_completions(state: NodeState, request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    return await dispatch(state, request, await prepare(state, raw))


async def handle_chat_completions(state: NodeState, request: web.Request) -> web.StreamResponse:
    """The chat form (node/chat.py): template the messages, then the completion path."""
    arrival = time.monotonic()
    chat = parse_chat(await request.read())
    ids = await asyncio.to_thread(template, state.engine.tokenizer, chat)
    body = as_completion(chat, ids)
    body.validate()
    return await dispatch(state, request, await prepare_body(state, body, arrival, chat=True))


async def dispatch(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    """The local leg, or the leg a role registered for the request's kv_transfer_params."""
    trigger = leg_trigger(prep)
    if trigger is None:
        return await local_leg(state, request, prep)
    leg = state.roles.legs.get(trigger)
    if leg is None:
        raise APIError(400, f"this node ({state.roles.describe()}) does not serve {trigger} legs",
                       param="kv_transfer_params")  # fmt: skip
    return await leg(state, request, prep)


def leg_trigger(prep: Prepared) -> str | None:
    """The leg a request asks for: its kv_transfer_params' flag (vLLM's names), or None."""
    if prep.kv_params is not None:
        kp = prep.kv_params
        return "do_remote_decode" if kp.do_remote_decode else "do_remote_prefill" if kp.do_remote_prefill else None
    raw = prep.body.kv_transfer_params
    if not raw:
        return None
    flags = [f for f in ("do_remote_decode", "do_remote_prefill") if raw.get(f) is not None]
    for f in flags:
        if not isinstance(raw[f], bool):
            raise APIError(400, f"kv_transfer_params.{f} must be a boolean", param="kv_transfer_params")
    on = [f for f in flags if raw[f]]
    if len(on) > 1:
        raise APIError(400, "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill",
                       param="kv_transfer_params")  # fmt: skip
    return on[0] if on else None


async def start(state: NodeState, engine_request_id: str, prep: Prepared, params: SamplingParams, *,
                hold_seconds: float | None = None, remote_num_tokens: int = 0) -> EngineStream:  # fmt: skip
    """Queue the request in the engine; a request the engine refuses is the client's 400
    (EngineOverloaded and EngineDead propagate: the app answers 503)."""
    try:
        return await state.engine.add_request(engine_request_id, prep.prompt_ids, params, prep.priority,
                                              hold_seconds=hold_seconds, remote_num_tokens=remote_num_tokens)  # fmt: skip
    except RequestRefused as e:
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
                  stream: EngineStream) -> web.StreamResponse:  # fmt: skip
    model = state.engine.model_name
    if prep.body.stream:
        chunker = None
        if prep.chat:
            opts = prep.body.stream_options
            chunker = ChatChunker(prep.request_id, model, include_usage=opts is None or opts.include_usage)
        return await responder.stream(request, stream, model, chunker)
    result = await responder.collect(stream, model)
    return answer(prep, result)


def answer(prep: Prepared, result: CompletionResponse) -> web.Response:
    """The JSON answer, in the shape the client asked for (completion or chat)."""
    body = chat_response(result) if prep.chat else result
    return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                        headers={"X-Request-Id": prep.request_id})  # fmt: skip


def new_request_id() -> str:
    """For requests that arrive without an X-Request-Id."""
    return f"cmpl-{uuid.uuid4().hex}"
