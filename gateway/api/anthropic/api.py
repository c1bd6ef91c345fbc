"""`POST /v1/messages`: Anthropic's Messages API, served by translation onto the chat path.

An Anthropic request becomes an OpenAI chat request (`to_chat`), runs through `serve.run` like
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
  `metadata.user_id` → `user`;
- usage: `input_tokens` is the prompt minus its cache reads (`cache_read_input_tokens`).
  A stream's `message_start` says 0 input tokens; `message_delta` carries the final counts.
- `stop_reason`: OpenAI's `stop` is `end_turn` (the chat path does not say whether a stop
  sequence or the end of the turn stopped it, so `stop_sequence` is not reported);
- vLLM's extras (`guided_choice`, `guided_regex`, `guided_json`, `structured_outputs`,
  `guided_decoding_backend`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`; sent
  through `extra_body`) → the same chat fields, checked as chat checks them
  (gateway/serving/constraint.py): one constraint per request, so a structured-output extra with
  `output_config.format` or a forced `tool_choice` (any or a named tool) is a 400 naming both.
"""

from __future__ import annotations

import json
import re
import time

import msgspec
from aiohttp import web

from gateway.accounts.auth import bearer
from gateway.accounts.ledger import Caller
from gateway.api import chat_body as chat
from gateway.api.anthropic.wire import (
    FIELDS,
    BlockDelta,
    BlockStart,
    BlockStop,
    ErrorBody,
    ErrorObject,
    ImageBlock,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessagesRequest,
    MessageStart,
    MessageStop,
    StopInfo,
    StreamEvent,
    TextBlock,
    TextDelta,
    TextOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
    sse,
)
from gateway.api.chat_answer import (
    ChatAnswer,
    ChatEvent,
    Done,
    Failed,
    Finish,
    Text,
    TokenCounts,
    ToolArgs,
    ToolStart,
    UsageSeen,
)
from gateway.api.translated import Translated, field_names, json_object, unknown_fields
from gateway.backends.providers.anthropic_shapes import (
    FINISH_REASONS,
    TOOL_CHOICES_BACK,
    error_type_of,
    input_tokens,
)
from gateway.serving.constraint import Names, vllm_fields
from gateway.state import GatewayState
from protocol.openai import APIError
from protocol.structured import JSONSchemaFormat, ResponseFormat

_ENC = msgspec.json.Encoder()
#: how this API calls the constraints of its own, in a 400 about two constraints
NAMES = Names(
    response_format="output_config.format", forced_tool="a forced tool_choice (any or a named tool)"
)


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.StreamResponse:
    """The handler: authenticate, translate, run on the chat path, translate back."""
    t0 = time.monotonic()
    call: Translated | None = None
    try:
        key = request.headers.get("x-api-key")
        if key is None and "Authorization" not in request.headers:
            raise APIError(
                401,
                "missing API key: send `x-api-key: <key>` or `Authorization: Bearer <key>`",
                type_="authentication_error",
                code="missing_api_key",
            )
        api_key, team = await state.auth.authenticate(
            request, key.strip() if key is not None else bearer(request)
        )
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            limit = state.config.server.max_body_bytes
            raise APIError(
                413, f"the request body is larger than this gateway accepts ({limit} bytes)"
            ) from None
        body = parse(raw)
        msg_id = "msg_" + request_id.removeprefix("req-")
        call = Translated(
            request,
            MessageStream(msg_id, body.model) if body.stream else None,
            {"request-id": request_id},
        )
        return await call.run(
            state,
            Caller(api_key, team, request_id, t0),
            to_chat(body),
            body.model,
            lambda answer, model: to_message(answer, msg_id, model),
        )
    except APIError as e:
        if call is not None and call.opened:
            raise  # the stream's own error event went out already (relay.py)
        return error_response(e, request_id)


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


def parse(raw: bytes) -> MessagesRequest:
    """The body, typed and checked (400s name what is wrong, in Anthropic's words where it has them)."""
    top = json_object(raw)
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
    return body


# -- Anthropic request → OpenAI chat request ------------------------------------------------


def _image(b: ImageBlock) -> chat.ImagePart:
    s = b.source
    if s.type == "base64":
        if not s.media_type or not s.data:
            raise APIError(400, "image source: base64 images need media_type and data")
        return chat.ImagePart(image_url=chat.ImageURL(url=f"data:{s.media_type};base64,{s.data}"))
    if not s.url:
        raise APIError(400, "image source: url images need a url")
    return chat.ImagePart(image_url=chat.ImageURL(url=s.url))


def _parts(blocks: list[TextBlock | ImageBlock]) -> str | list[chat.TextPart | chat.ImagePart]:
    if all(isinstance(b, TextBlock) for b in blocks):
        return "".join(b.text for b in blocks)  # type: ignore[union-attr]
    return [chat.TextPart(text=b.text) if isinstance(b, TextBlock) else _image(b) for b in blocks]


def _result_text(b: ToolResultBlock) -> str | list[chat.TextPart | chat.ImagePart]:
    content = b.content if b.content is not None else ""
    out = content if isinstance(content, str) else _parts(content)
    if b.is_error and isinstance(out, str):
        return f"Error: {out}"  # OpenAI's tool message has no error flag: the model reads it
    return out


def _turn(role: str, content: str | list, out: list[chat.Message]) -> None:  # type: ignore[type-arg]
    if isinstance(content, str):
        chat.append(out, chat.Message(role=role, content=content))  # type: ignore[arg-type]
        return
    parts: list[TextBlock | ImageBlock] = []
    calls: list[chat.ToolCall] = []
    results = 0
    for b in content:
        if isinstance(b, ToolResultBlock):
            results += 1
            if role != "user":
                raise APIError(400, "tool_result blocks belong in a user turn")
            out.append(
                chat.Message(role="tool", tool_call_id=b.tool_use_id, content=_result_text(b))
            )
        elif isinstance(b, ToolUseBlock):
            if role != "assistant":
                raise APIError(400, "tool_use blocks belong in an assistant turn")
            calls.append(
                chat.ToolCall(
                    id=b.id, function=chat.FunctionCall(name=b.name, arguments=json.dumps(b.input))
                )
            )
        else:
            parts.append(b)
    if parts or not (calls or results):
        chat.append(out, chat.Message(role=role, content=_parts(parts), tool_calls=calls or None))  # type: ignore[arg-type]
    elif calls:
        chat.append(out, chat.Message(role="assistant", tool_calls=calls))


def to_chat(body: MessagesRequest) -> chat.ChatBody:
    messages: list[chat.Message] = []
    if body.system is not None:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        if system:
            messages.append(chat.Message(role="system", content=system))
    for m in body.messages:
        _turn(m.role, m.content, messages)
    out = chat.ChatBody(
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=body.stop_sequences or None,
        user=body.metadata.user_id if body.metadata else None,
    )
    if body.stream:
        out.stream, out.stream_options = True, chat.StreamOptions(include_usage=True)
    if body.tools:
        out.tools = [
            chat.ToolDef(
                type="function",
                function=chat.FunctionDef(
                    name=t.name, description=t.description, parameters=t.input_schema
                ),
            )
            for t in body.tools
        ]
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is not None:
        out.response_format = ResponseFormat(
            type="json_schema", json_schema=JSONSchemaFormat(name="output", schema=fmt.schema)
        )
    tc = body.tool_choice
    if tc is not None:
        kind = type(tc).__struct_config__.tag
        if kind == "tool":
            out.tool_choice = chat.NamedToolChoice(
                type="function", function=chat.NamedFunction(name=tc.name)
            )  # type: ignore[union-attr]
        else:
            out.tool_choice = TOOL_CHOICES_BACK[str(kind)]  # type: ignore[assignment]
        if tc.disable_parallel_tool_use:
            out.parallel_tool_calls = False
    chat.copy_extras(body, out)
    out.top_k = body.top_k  # Anthropic's own field
    chat.check_constraint(out, NAMES)
    return out


# -- OpenAI answer → Anthropic message ------------------------------------------------------


def _usage(u: TokenCounts) -> Usage:
    fresh, cached = input_tokens(u.prompt_tokens, u.cached_tokens)
    return Usage(
        input_tokens=fresh, output_tokens=u.completion_tokens, cache_read_input_tokens=cached
    )


def _input(arguments: str) -> dict[str, object] | None:
    try:
        v = json.loads(arguments or "{}")
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


def to_message(a: ChatAnswer, msg_id: str, model: str) -> Message:
    content: list[TextOut | ToolUseOut] = []
    text = a.text
    for c in a.tool_calls:
        args = _input(c.arguments)
        if args is None:  # never half a call: what is not a JSON object stays the model's text
            text += c.arguments
        else:
            content.append(ToolUseOut(id=c.id, name=c.name, input=args))
    if text or not content:
        content.insert(0, TextOut(text=text))
    stop = FINISH_REASONS.get(a.finish_reason or "stop", "end_turn")
    if stop == "tool_use" and not any(isinstance(b, ToolUseOut) for b in content):
        stop = "end_turn"
    return Message(id=msg_id, model=model, content=content, stop_reason=stop, usage=_usage(a.usage))


class MessageStream:
    """Chat stream events → Anthropic's event sequence (a `chat_answer.Renderer`)."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self._started = False
        self._block: int | None = None  # the open block's index
        self._text_open = False
        self._blocks = 0
        self._tool_block: dict[int, int] = {}  # tool call index → its block
        self._stop = "end_turn"
        self._usage = TokenCounts()
        self._failed = False

    def start(self, headers: dict[str, str]) -> None:
        self.model = headers.get("x-duet-model-used", self.model)

    def _close(self, out: list[StreamEvent]) -> None:
        if self._block is not None:
            out.append(BlockStop(index=self._block))
            self._block, self._text_open = None, False

    def _open(self, block: TextOut | ToolUseOut, out: list[StreamEvent]) -> int:
        self._close(out)
        self._block, self._blocks = self._blocks, self._blocks + 1
        out.append(BlockStart(index=self._block, content_block=block))
        return self._block

    def render(self, events: list[ChatEvent]) -> bytes:
        out: list[StreamEvent] = []
        for ev in events:
            if self._failed:
                break
            if not self._started and not isinstance(ev, Failed):
                self._started = True
                out.append(
                    MessageStart(
                        message=Message(
                            id=self.msg_id,
                            model=self.model,
                            content=[],
                            usage=Usage(input_tokens=0, output_tokens=0),
                        )
                    )
                )
            if isinstance(ev, Text):
                if not self._text_open:
                    self._open(TextOut(text=""), out)
                    self._text_open = True
                out.append(BlockDelta(index=self._block or 0, delta=TextDelta(text=ev.text)))
            elif isinstance(ev, ToolStart):
                self._tool_block[ev.index] = self._open(
                    ToolUseOut(id=ev.id, name=ev.name, input={}), out
                )
            elif isinstance(ev, ToolArgs):
                out.append(
                    BlockDelta(
                        index=self._tool_block.get(ev.index, self._block or 0),
                        delta=InputJsonDelta(partial_json=ev.delta),
                    )
                )
            elif isinstance(ev, Finish):
                self._close(out)
                self._stop = FINISH_REASONS.get(ev.reason, "end_turn")
            elif isinstance(ev, UsageSeen):
                self._usage = ev.usage
            elif isinstance(ev, Failed):
                self._failed = True
                status = ev.error.code if isinstance(ev.error.code, int) else 500
                out.append(
                    ErrorBody(
                        error=ErrorObject(type=error_type_of(status), message=ev.error.message)
                    )
                )
            elif isinstance(ev, Done):
                self._close(out)
                out.append(
                    MessageDelta(delta=StopInfo(stop_reason=self._stop), usage=_usage(self._usage))
                )
                out.append(MessageStop())
        return b"".join(sse(e) for e in out)
