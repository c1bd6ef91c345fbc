"""OpenAI Responses ↔ OpenAI chat, for `/v1/responses` (api.py says the mapping): the request
into the typed chat request the pipeline serves (`to_chat`), a whole chat answer back into a
`response` object (`to_response`). The stream's way back is stream.py's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from gateway.api.chat_answer import ChatAnswer, TokenCounts
from gateway.api.chat_body import (
    Part,
    TranslatedChat,
    append,
    check_constraint,
    copy_extras,
    image_part,
    text_part,
)
from gateway.api.responses.wire import (
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputDetails,
    InputImage,
    InputText,
    MessageItem,
    NamedFunction,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    OutputTextPart,
    Response,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from gateway.serving.constraint import Names
from protocol.chat import ChatCompletionRequest, ChatMessage
from protocol.openai import APIError, StreamOptions
from protocol.structured import JSONSchemaFormat, ResponseFormat
from protocol.tools import FunctionCall, FunctionDef, NamedToolChoice, ToolCall, ToolDef
from protocol.tools import NamedFunction as ToolName

#: how this API calls the constraints of its own, in a 400 about two constraints
NAMES = Names(response_format="text.format")


def _content(
    parts: str | Sequence[InputText | OutputText | InputImage],
) -> str | list[Part]:
    if isinstance(parts, str):
        return parts
    texts = [p for p in parts if not isinstance(p, InputImage)]
    if len(texts) == len(parts):
        return "".join(p.text for p in texts)
    out: list[Part] = []
    for p in parts:
        if isinstance(p, InputImage):
            if p.image_url is None:
                raise APIError(
                    400, "input_image needs an image_url (files are not stored here)", param="input"
                )
            out.append(image_part(p.image_url))
        else:
            out.append(text_part(p.text))
    return out


def to_chat(body: ResponsesRequest) -> TranslatedChat:
    """The Responses request as the chat request it is served as (see api.py's mapping)."""
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    items = (
        [MessageItem(role="user", content=body.input)]
        if isinstance(body.input, str)
        else body.input
    )
    for it in items:
        if isinstance(it, MessageItem):
            role = "system" if it.role == "developer" else it.role
            append(messages, ChatMessage(role=role, content=_content(it.content)))
        elif isinstance(it, FunctionCallItem):
            call = ToolCall(
                id=it.call_id, function=FunctionCall(name=it.name, arguments=it.arguments)
            )
            append(messages, ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(it, FunctionCallOutputItem):
            content = _content(it.output)
            messages.append(ChatMessage(role="tool", tool_call_id=it.call_id, content=content))
    out = ChatCompletionRequest(
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
        out.stream, out.stream_options = True, StreamOptions(include_usage=True)
    if body.tools:
        out.tools = [
            ToolDef(
                type="function",
                function=FunctionDef(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                ),
            )
            for t in body.tools
        ]
    tc = body.tool_choice
    if isinstance(tc, NamedFunction):
        out.tool_choice = NamedToolChoice(type="function", function=ToolName(name=tc.name))
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
    copy_extras(body, out)
    check_constraint(out, body, NAMES)
    return TranslatedChat(out, body)


def _usage(u: TokenCounts) -> ResponseUsage:
    return ResponseUsage(
        input_tokens=u.prompt_tokens,
        input_tokens_details=InputDetails(cached_tokens=u.cached_tokens),
        output_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
    )


def shell(rid: str, body: ResponsesRequest, model: str, created: int) -> Response:
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


def finish(r: Response, finish: str | None, usage: TokenCounts) -> None:
    r.usage = _usage(usage)
    if finish == "length":
        r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="max_output_tokens")
    elif finish == "content_filter":
        r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="content_filter")
    elif finish == "pause_turn":  # the turn did not end: the client continues it
        r.status, r.incomplete_details = "incomplete", IncompleteDetails(reason="pause_turn")
    else:
        r.status = "completed"


def item_status(finish: str | None) -> Literal["completed", "incomplete"]:
    """An output item's status: incomplete where the answer was cut or its turn paused."""
    return "incomplete" if finish in ("length", "pause_turn") else "completed"


def to_response(a: ChatAnswer, rid: str, body: ResponsesRequest, model: str) -> Response:
    r = shell(rid, body, model, int(time.time()))
    done = item_status(a.finish_reason)
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
    finish(r, a.finish_reason, a.usage)
    return r
