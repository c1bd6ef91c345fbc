"""`POST /v1/messages`: Anthropic's Messages API, served by translation onto the chat path.

An Anthropic request becomes an OpenAI chat request (`to_chat`), runs through the one pipeline like
any `/v1/chat/completions` call — the same keys, teams, quotas, tiers, `auto`, fallback chains
and usage records, on every model, self-hosted or external — and its answer is translated back:
a whole `chat.completion` into a Message (`to_message`), a chat stream into Anthropic's event
sequence (`MessageStream`: message_start, content_block_start / _delta / _stop per block,
message_delta with the stop reason and the usage, message_stop).

The key comes as `x-api-key` (Anthropic's clients) or `Authorization: Bearer`. Every error —
the key, the body, the chat path's own refusals — is answered in Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` with the chat path's status; one that happens
after a stream opened is an `error` event.

Mapping (the shared names are in providers/anthropic_shapes.py):
- `system` → a system message; `tool_use` blocks → the assistant turn's `tool_calls`;
  `tool_result` blocks → `tool` messages (before the turn's text, as Anthropic orders them);
  `image` blocks → `image_url` parts;
- `output_config.format` (a JSON schema) → `response_format` json_schema;
- `tool_choice` auto|any|tool|none → auto|required|a named function|none;
  `disable_parallel_tool_use` → `parallel_tool_calls: false`; `stop_sequences` → `stop`;
  `metadata.user_id` → `user` (the usage record's end user);
- the `anthropic-version` and `anthropic-beta` headers, `thinking` and image blocks: taken where
  served, else a 400 saying why (surface.py);
- usage: `input_tokens` is the prompt minus its cache reads (`cache_read_input_tokens`).
  A stream's `message_start` says 0 input tokens; `message_delta` carries the final counts.
- a tool call's arguments → a `tool_use` block's `input`, wrapped as `{"value": …}` when they
  are no JSON object (convert.py `tool_input`), so a called tool is never text;
- `stop_reason`: OpenAI's `stop` is `end_turn` (the chat path does not say whether a stop
  sequence or the end of the turn stopped it, so `stop_sequence` is not reported);
- vLLM's extras (`guided_choice`, `guided_regex`, `guided_json`, `structured_outputs`,
  `guided_decoding_backend`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`; sent
  through `extra_body`) → the same chat fields, checked as chat checks them
  (gateway/serving/constraint.py): one constraint per request, so a structured-output extra with
  `output_config.format` or a forced `tool_choice` (any or a named tool) is a 400 naming both.
"""

from __future__ import annotations

import re
import time

import msgspec
from aiohttp import web

from gateway.accounts.auth import bearer
from gateway.accounts.idempotency import HEADER, caller_of
from gateway.accounts.key_cache import Found
from gateway.api.anthropic.convert import to_chat, to_message
from gateway.api.anthropic.stream import MessageStream
from gateway.api.anthropic.surface import check_headers, refuse_images, refuse_thinking
from gateway.api.anthropic.wire import (
    FIELDS,
    ErrorBody,
    ErrorObject,
    MessagesRequest,
)
from gateway.api.translated import Translated, field_names
from gateway.backends.providers.anthropic_shapes import (
    error_type_of,
)
from gateway.config_tables import ModelConfig
from gateway.serving.raw_body import decode_json, unknown_fields, vllm_fields
from gateway.state import GatewayState
from protocol.openai import APIError

_ENC = msgspec.json.Encoder()


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.StreamResponse:
    """The handler: authenticate, translate, run on the chat path, translate back."""
    t0 = time.monotonic()
    call: Translated | None = None
    try:
        api_key, team = await authenticate(state, request)
        raw = await read_body(state, request)
        body = parse(raw)
        refuse_thinking(body, _config(state, body.model))
        caller = caller_of(api_key, team, request_id, t0, request.headers.get(HEADER))
        request_id = caller.request_id
        msg_id = "msg_" + request_id.removeprefix("req-")
        call = Translated(
            request,
            MessageStream(msg_id, body.model) if body.stream else None,
            {"request-id": request_id},
        )
        return await call.run(
            state,
            caller,
            to_chat(body),
            body.model,
            lambda answer, model: to_message(answer, msg_id, model),
        )
    except APIError as e:
        if call is not None and call.opened:
            raise  # the stream's own error event went out already (relay.py)
        return error_response(e, request_id)


def _config(state: GatewayState, name: str) -> ModelConfig | None:
    """The config of the model `name` names, if this gateway serves one by that name."""
    served = state.serving.models.get(name)
    return served.config if served is not None else None


async def authenticate(state: GatewayState, request: web.Request) -> Found:
    """The caller's key (`x-api-key`, Anthropic's clients, or `Authorization: Bearer`) and team."""
    key = request.headers.get("x-api-key")
    if key is None and "Authorization" not in request.headers:
        raise APIError(
            401,
            "missing API key: send `x-api-key: <key>` or `Authorization: Bearer <key>`",
            type_="authentication_error",
            code="missing_api_key",
        )
    found = await state.auth.authenticate(
        request, key.strip() if key is not None else bearer(request)
    )
    check_headers(request.headers)  # anthropic-version, anthropic-beta (surface.py)
    return found


async def read_body(state: GatewayState, request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = state.config.server.max_body_bytes
        raise APIError(
            413, f"the request body is larger than this gateway accepts ({limit} bytes)"
        ) from None


def error_response(e: APIError, request_id: str) -> web.Response:
    """An APIError in Anthropic's error shape, with its status and headers (Retry-After, …).
    That shape has no `param`: the field a 400 names (the chat path's own checks, the grammar
    engine's verdict on a `guided_regex`, …) leads the message unless the message names it (as a
    word), as Anthropic's own `field: message` errors do."""
    named = (
        e.param is not None
        and re.search(rf"(?<!\w){re.escape(e.param)}(?!\w)", e.message) is not None
    )
    message = e.message if e.param is None or named else f"{e.param}: {e.message}"
    body = ErrorBody(error=ErrorObject(type=error_type_of(e.status), message=message))
    return web.Response(
        status=e.status,
        body=_ENC.encode(body),
        content_type="application/json",
        headers={**e.response_headers(), "X-Request-Id": request_id, "request-id": request_id},
    )


def _neutral(v: object) -> bool:
    return v is None or v is False or v == [] or v == {} or v == {"type": "disabled"}


def parse(raw: bytes, counting: bool = False) -> MessagesRequest:
    """The body, typed and checked (400s name what is wrong, in Anthropic's words where it has
    them). `counting`: a count_tokens body, which has no `max_tokens` (one stands in for it)."""
    top = decode_json(raw, code=None)
    if counting:
        top.setdefault("max_tokens", 1)
    extra = unknown_fields(top, FIELDS, _neutral)
    if extra:
        raise APIError(
            400,
            f"{field_names(extra)}: Extra inputs are not permitted (not supported by this gateway)",
        )
    for k in ("model", "messages", "max_tokens"):
        if k not in top:
            raise APIError(400, f"{k}: Field required")
    vllm_fields(top)  # vLLM's extras: a wrong type is chat's 400, in chat's words
    try:
        body = msgspec.convert(top, MessagesRequest)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid request: {e}") from None
    if body.max_tokens < 1:
        raise APIError(400, f"max_tokens: must be at least 1, got {body.max_tokens}")
    if not body.messages:
        raise APIError(400, "messages: at least one message is required")
    if body.temperature is not None and not 0 <= body.temperature <= 1:
        raise APIError(400, f"temperature: must be between 0 and 1, got {body.temperature}")
    if body.top_k is not None and body.top_k < 1:
        raise APIError(400, f"top_k: must be a positive integer, got {body.top_k}")
    if any(not s for s in body.stop_sequences or []):
        raise APIError(400, "stop_sequences: each must be a non-empty string")
    refuse_images(body)
    return body
