"""`POST /v1/responses`: OpenAI's Responses API, stateless, served by translation onto the chat
path.

As for `/v1/messages` (api/anthropic/), the request becomes an OpenAI chat request and runs
through the one pipeline — keys, quotas, tiers, `auto`, fallback, billing and every model — and
the answer is translated back: a whole `chat.completion` into a `response` object, a chat stream
into the Responses events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done,
response.function_call_arguments.delta / .done, response.output_item.done, and
response.completed — or response.incomplete when max_output_tokens cut the answer).

Mapping: `instructions` → a system message first; `input` items → chat messages (a
`function_call` item joins the assistant turn before it as a tool call, a `function_call_output`
item is a `tool` message); function tools → chat tools; `tool_choice` as is; `max_output_tokens`
→ max_tokens; `text.format` → response_format; vLLM's extras (`guided_choice`, `guided_regex`,
`guided_json`, `structured_outputs`, `guided_decoding_backend`, `top_k`, `min_p`,
`repetition_penalty`, `min_tokens`, `ignore_eos`; sent through `extra_body`) → the same chat
fields, checked as chat checks them (gateway/serving/constraint.py): one constraint per request,
so a structured-output extra with `text.format` json_object / json_schema or a forced
`tool_choice` is a 400 naming both. Errors are OpenAI's error body (the shared middleware), a
stream's failure an `error` event.

Stateless: nothing is stored, so `previous_response_id` is refused with a 400 that says so
(send the conversation in `input`), and `store` is answered as false.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from gateway.accounts.idempotency import HEADER, caller_of
from gateway.api.responses.convert import to_chat, to_response
from gateway.api.responses.stream import ResponseStream
from gateway.api.responses.wire import (
    FIELDS,
    ResponsesRequest,
)
from gateway.api.translated import Translated, field_names
from gateway.serving.raw_body import decode_json, unknown_fields, vllm_fields
from gateway.state import GatewayState
from protocol.openai import APIError

_ENC = msgspec.json.Encoder()


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.StreamResponse:
    t0 = time.monotonic()
    key, team = await state.auth.authenticate(request)
    body = parse(await request.read())
    caller = caller_of(key, team, request_id, t0, request.headers.get(HEADER))
    rid = caller.request_id.removeprefix("req-")
    call = Translated(request, ResponseStream(rid, body) if body.stream else None)
    return await call.run(
        state,
        caller,
        to_chat(body),
        body.model,
        lambda answer, model: to_response(answer, rid, body, model),
    )


def _neutral(v: object) -> bool:
    return v is None or v is False or v == [] or v == {}


def parse(raw: bytes) -> ResponsesRequest:
    top = decode_json(raw)
    if top.get("previous_response_id") is not None:
        raise APIError(
            400,
            "previous_response_id is not supported: this gateway stores no responses (send the "
            "whole conversation in `input`)",
            param="previous_response_id",
            code="unsupported_field",
        )
    if top.get("background"):
        raise APIError(
            400,
            "background responses are not supported",
            param="background",
            code="unsupported_field",
        )
    extra = unknown_fields(top, FIELDS | {"background"}, _neutral)
    if extra:
        raise APIError(
            400,
            f"unsupported field{'s' if len(extra) > 1 else ''}: {field_names(extra)}",
            param=extra[0],
            code="unsupported_field",
        )
    for k in ("model", "input"):
        if k not in top:
            raise APIError(400, f"missing required field: {k}", param=k)
    vllm_fields(top)  # vLLM's extras: a wrong type is chat's 400, in chat's words (param included)
    if isinstance(top["input"], list):  # an "easy" message item has no type
        top["input"] = [
            {**it, "type": "message"}
            if isinstance(it, dict) and "type" not in it and "role" in it
            else it
            for it in top["input"]
        ]
    try:
        body = msgspec.convert(top, ResponsesRequest)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = (
            msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
            if "`$." in msg
            else None
        )
        raise APIError(400, f"invalid request: {msg}", param=param) from None
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise APIError(
            400,
            f"max_output_tokens must be at least 1, got {body.max_output_tokens}",
            param="max_output_tokens",
        )
    if not body.input:
        raise APIError(400, "input must not be empty", param="input")
    return body
