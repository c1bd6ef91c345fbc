"""`POST /v1/responses`: OpenAI's Responses API, stateless, served by translation onto the chat path.

As for `/v1/messages` (anthropic_api.py), the request becomes an OpenAI chat request and runs
through `serve.run` — keys, quotas, tiers, `auto`, fallback, billing and every model — and the
answer is translated back: a whole `chat.completion` into a `response` object, a chat stream
into the Responses events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done,
response.function_call_arguments.delta / .done, response.output_item.done, and
response.completed — or response.incomplete when max_output_tokens cut the answer).

Mapping: `instructions` → a system message first; `input` items → chat messages (a
`function_call` item joins the assistant turn before it as a tool call, a
`function_call_output` item is a `tool` message); function tools → chat tools; `tool_choice`
as is; `max_output_tokens` → max_tokens; `text.format` → response_format; vLLM's extras
(`guided_choice`, `guided_regex`, `guided_json`, `structured_outputs`, `guided_decoding_backend`,
`top_k`, `min_p`, `repetition_penalty`, `min_tokens`, `ignore_eos`; sent through `extra_body`)
→ the same chat fields, checked as chat checks them (gateway/serving/constraint.py): one constraint per
request, so a structured-output extra with `text.format` json_object / json_schema or a forced
`tool_choice` is a 400 naming both. Errors are OpenAI's error body (the shared middleware), a
stream's failure an `error` event.

Stateless: nothing is stored, so `previous_response_id` is refused with a 400 that says so
(send the conversation in `input`), and `store` is answered as false.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from gateway.accounts.ledger import Caller
from gateway.api import chat_body as chat
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
from gateway.api.responses.wire import (
    FIELDS,
    ArgsDelta,
    ArgsDone,
    Completed,
    Created,
    FunctionCallItem,
    FunctionCallOutputItem,
    Incomplete,
    IncompleteDetails,
    InProgress,
    InputDetails,
    InputImage,
    InputText,
    ItemAdded,
    ItemDone,
    MessageItem,
    NamedFunction,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTextPart,
    PartAdded,
    PartDone,
    Response,
    ResponsesRequest,
    ResponseUsage,
    StreamError,
    StreamEvent,
    TextConfig,
    TextDelta,
    TextDone,
    sse,
)
from gateway.api.translated import Translated, field_names, json_object, unknown_fields
from gateway.serving.constraint import Names, vllm_fields
from gateway.state import GatewayState
from protocol.openai import APIError
from protocol.structured import JSONSchemaFormat, ResponseFormat

_ENC = msgspec.json.Encoder()
#: how this API calls the constraints of its own, in a 400 about two constraints
NAMES = Names(response_format="text.format")


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.StreamResponse:
    t0 = time.monotonic()
    key, team = await state.auth.authenticate(request)
    body = parse(await request.read())
    rid = request_id.removeprefix("req-")
    call = Translated(request, ResponseStream(rid, body) if body.stream else None)
    return await call.run(
        state,
        Caller(key, team, request_id, t0),
        to_chat(body),
        body.model,
        lambda answer, model: to_response(answer, rid, body, model),
    )


def _neutral(v: object) -> bool:
    return v is None or v is False or v == [] or v == {}


def parse(raw: bytes) -> ResponsesRequest:
    top = json_object(raw, code="invalid_json")
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


# -- Responses request → OpenAI chat request ------------------------------------------------


def _content(
    parts: str | list[InputText | OutputText | InputImage],
) -> str | list[chat.TextPart | chat.ImagePart]:
    if isinstance(parts, str):
        return parts
    if all(not isinstance(p, InputImage) for p in parts):
        return "".join(p.text for p in parts)  # type: ignore[union-attr]
    out: list[chat.TextPart | chat.ImagePart] = []
    for p in parts:
        if isinstance(p, InputImage):
            if p.image_url is None:
                raise APIError(
                    400, "input_image needs an image_url (files are not stored here)", param="input"
                )
            out.append(chat.ImagePart(image_url=chat.ImageURL(url=p.image_url)))
        else:
            out.append(chat.TextPart(text=p.text))
    return out


def to_chat(body: ResponsesRequest) -> chat.ChatBody:
    messages: list[chat.Message] = []
    if body.instructions:
        messages.append(chat.Message(role="system", content=body.instructions))
    items = (
        [MessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else body.input
    )
    for it in items:
        if isinstance(it, MessageItem):
            role = "system" if it.role == "developer" else it.role
            chat.append(messages, chat.Message(role=role, content=_content(it.content)))
        elif isinstance(it, FunctionCallItem):
            call = chat.ToolCall(
                id=it.call_id, function=chat.FunctionCall(name=it.name, arguments=it.arguments)
            )
            chat.append(messages, chat.Message(role="assistant", tool_calls=[call]))
        elif isinstance(it, FunctionCallOutputItem):
            out = it.output if isinstance(it.output, str) else _content(it.output)  # type: ignore[arg-type]
            messages.append(chat.Message(role="tool", tool_call_id=it.call_id, content=out))
    out = chat.ChatBody(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        user=body.user,
        service_tier=body.service_tier,
        parallel_tool_calls=body.parallel_tool_calls,
    )
    if body.stream:
        out.stream, out.stream_options = True, chat.StreamOptions(include_usage=True)
    if body.tools:
        out.tools = [
            chat.ToolDef(
                type="function",
                function=chat.FunctionDef(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in body.tools
        ]
    tc = body.tool_choice
    if isinstance(tc, NamedFunction):
        out.tool_choice = chat.NamedToolChoice(
            type="function", function=chat.NamedFunction(name=tc.name)
        )
    elif tc is not None:
        out.tool_choice = tc
    f = body.text.format if body.text is not None else None
    if f is not None and f.type == "json_object":
        out.response_format = ResponseFormat(type="json_object")
    elif f is not None and f.type == "json_schema":
        if not f.name or f.schema is None:
            raise APIError(
                400, "text.format of type json_schema needs name and schema", param="text"
            )
        out.response_format = ResponseFormat(
            type="json_schema",
            json_schema=JSONSchemaFormat(
                name=f.name, schema=f.schema, strict=f.strict, description=f.description
            ),
        )
    chat.copy_extras(body, out)
    chat.check_constraint(out, NAMES)
    return out


# -- OpenAI answer → Responses object -------------------------------------------------------


def _usage(u: TokenCounts) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputDetails(cached_tokens=u.cached_tokens),
        output_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


def _shell(rid: str, body: ResponsesRequest, model: str, created: int) -> Response:
    """The response object as the request shapes it (status, output and usage filled later)."""
    return Response(
        id=f"resp_{rid}",
        created_at=created,
        status="in_progress",
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        model=model,
        output=[],
        parallel_tool_calls=body.parallel_tool_calls is not False,
        temperature=body.temperature,
        top_p=body.top_p,
        tool_choice=body.tool_choice or "auto",
        tools=list(body.tools or []),
        text=body.text or TextConfig(),
        truncation=body.truncation or "disabled",
        metadata=body.metadata or {},
        user=body.user,
    )


def _finish(r: Response, finish: str | None, usage: TokenCounts) -> None:
    r.usage = _usage(usage)
    if finish == "length":
        r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
    elif finish == "content_filter":
        r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="content_filter")
    else:
        r.status = "completed"


def to_response(a: ChatAnswer, rid: str, body: ResponsesRequest, model: str) -> Response:
    r = _shell(rid, body, model, int(time.time()))
    done = "incomplete" if a.finish_reason == "length" else "completed"
    if a.text:
        r.output.append(
            OutputMessage(id=f"msg_{rid}", status=done, content=[OutputTextPart(text=a.text)])
        )
    for i, c in enumerate(a.tool_calls):
        r.output.append(
            OutputFunctionCall(
                id=f"fc_{rid}_{i}",
                call_id=c.id,
                name=c.name,
                arguments=c.arguments,
                status="completed",
            )
        )
    _finish(r, a.finish_reason, a.usage)
    return r


class ResponseStream:
    """Chat stream events → the Responses API's events (a `chat_answer.Renderer`)."""

    def __init__(self, rid: str, body: ResponsesRequest) -> None:
        self.rid, self.body = rid, body
        self.response = _shell(rid, body, body.model, int(time.time()))
        self._seq = 0
        self._started = False
        self._open: OutputItem | None = None
        self._open_at = 0  # the open item's output index
        self._tool_item: dict[int, int] = {}  # tool call index → its output index
        self._finish: str | None = None
        self._usage = TokenCounts()
        self._failed = False

    def start(self, headers: dict[str, str]) -> None:
        self.response.model = headers.get("x-duet-model-used", self.response.model)

    def _n(self) -> int:
        self._seq += 1
        return self._seq - 1

    def _close(self, out: list[StreamEvent]) -> None:
        item, self._open, i = self._open, None, self._open_at
        if item is None:
            return
        status = "incomplete" if self._finish == "length" else "completed"
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out.append(
                TextDone(
                    sequence_number=self._n(),
                    item_id=item.id,
                    output_index=i,
                    content_index=0,
                    text=part.text,
                )
            )
            out.append(
                PartDone(
                    sequence_number=self._n(),
                    item_id=item.id,
                    output_index=i,
                    content_index=0,
                    part=part,
                )
            )
        else:
            out.append(
                ArgsDone(
                    sequence_number=self._n(),
                    item_id=item.id,
                    output_index=i,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        item.status = status
        out.append(ItemDone(sequence_number=self._n(), output_index=i, item=item))

    def _add(self, item: OutputItem, out: list[StreamEvent]) -> int:
        self._close(out)
        self._open = item
        self.response.output.append(item)
        i = self._open_at = len(self.response.output) - 1
        out.append(ItemAdded(sequence_number=self._n(), output_index=i, item=_copy(item)))
        return i

    def render(self, events: list[ChatEvent]) -> bytes:
        out: list[StreamEvent] = []
        for ev in events:
            if self._failed:
                break
            if not self._started and not isinstance(ev, Failed):
                self._started = True
                out.append(Created(sequence_number=self._n(), response=_copy(self.response)))
                out.append(InProgress(sequence_number=self._n(), response=_copy(self.response)))
            if isinstance(ev, Text):
                item = self._open
                if not isinstance(item, OutputMessage):
                    n = len(self.response.output)
                    item = OutputMessage(id=f"msg_{self.rid}_{n}", status="in_progress", content=[])
                    i = self._add(item, out)
                    item.content.append(OutputTextPart(text=""))
                    out.append(
                        PartAdded(
                            sequence_number=self._n(),
                            item_id=item.id,
                            output_index=i,
                            content_index=0,
                            part=OutputTextPart(text=""),
                        )
                    )
                part = item.content[0]
                part.text += ev.text
                out.append(
                    TextDelta(
                        sequence_number=self._n(),
                        item_id=item.id,
                        output_index=self._open_at,
                        content_index=0,
                        delta=ev.text,
                    )
                )
            elif isinstance(ev, ToolStart):
                fc = OutputFunctionCall(
                    id=f"fc_{self.rid}_{ev.index}",
                    call_id=ev.id,
                    name=ev.name,
                    arguments="",
                    status="in_progress",
                )
                self._tool_item[ev.index] = self._add(fc, out)
            elif isinstance(ev, ToolArgs):
                i = self._tool_item.get(ev.index)
                item = self.response.output[i] if i is not None else None
                if isinstance(item, OutputFunctionCall):
                    item.arguments += ev.delta
                    out.append(
                        ArgsDelta(
                            sequence_number=self._n(),
                            item_id=item.id,
                            output_index=i,
                            delta=ev.delta,
                        )
                    )  # type: ignore[arg-type]
            elif isinstance(ev, Finish):
                self._finish = ev.reason
                self._close(out)
            elif isinstance(ev, UsageSeen):
                self._usage = ev.usage
            elif isinstance(ev, Failed):
                self._failed = True
                code = ev.error.code if isinstance(ev.error.code, str) else None
                out.append(
                    StreamError(sequence_number=self._n(), message=ev.error.message, code=code)
                )
            elif isinstance(ev, Done):
                self._close(out)
                _finish(self.response, self._finish, self._usage)
                done = Incomplete if self.response.status == "incomplete" else Completed
                out.append(done(sequence_number=self._n(), response=self.response))
        return b"".join(sse(e) for e in out)


def _copy(x: object) -> object:
    """A snapshot of `x` as it is now (the stream keeps changing the item and the response)."""
    return msgspec.json.decode(_ENC.encode(x), type=type(x))
