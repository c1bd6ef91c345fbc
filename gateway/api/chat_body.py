"""The OpenAI chat request that `/v1/messages` and `/v1/responses` are translated into.

Both APIs run on the gateway's chat path (see chat_answer.py): they build a `ChatBody` and hand
its JSON to `serve.run`, which parses and checks it as it checks any client's. The tool shapes
are protocol/tools.py's (re-exported here for the two translators). Every field is
omitted when unset (`omit_defaults`), so a request that uses no tools carries no `tools` key
and is served by every model the chat path serves.

vLLM's request extras (`VllmExtras`: the structured-output fields of gateway/serving/constraint.py and
vLLM's sampling fields top_k, min_p, repetition_penalty, min_tokens, ignore_eos) are fields of
both APIs' request structs and of `ChatBody` alike (one inherited definition): `copy_extras`
carries them over unchanged, so the chat path's parser checks them with chat's own messages,
and `check_constraint` first checks the request's one constraint with the API's names.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from gateway.serving.constraint import Names, VllmFields, constraint, refuse_min_tokens
from protocol.structured import ResponseFormat
from protocol.tools import (
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDef,
)


class TextPart(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ImageURL(msgspec.Struct, kw_only=True):
    url: str


class ImagePart(msgspec.Struct, kw_only=True, tag="image_url", tag_field="type"):
    image_url: ImageURL


class Message(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = True


class VllmExtras(VllmFields, kw_only=True):
    """vLLM's request extras as `/v1/messages` and `/v1/responses` take them (clients send them
    in `extra_body`), typed as chat takes them; their ranges are checked by the chat path's
    parser (gateway/serving/requests.py), their constraint by gateway/serving/constraint.py."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


#: the extras' names (an API's request struct inherits them: its accepted fields include these)
EXTRAS = frozenset(VllmExtras.__struct_fields__)


class ChatBody(VllmExtras, kw_only=True, omit_defaults=True):
    model: str
    messages: list[Message]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    service_tier: str | None = None


__all__ = [
    "EXTRAS",
    "ChatBody",
    "FunctionCall",
    "FunctionDef",
    "ImagePart",
    "ImageURL",
    "Message",
    "NamedFunction",
    "NamedToolChoice",
    "StreamOptions",
    "TextPart",
    "ToolCall",
    "ToolDef",
    "VllmExtras",
    "append",
    "check_constraint",
    "copy_extras",
    "encode",
]
_ENC = msgspec.json.Encoder()


def encode(body: ChatBody) -> bytes:
    return _ENC.encode(body)


def append(messages: list[Message], m: Message) -> None:
    """Add `m`; an assistant turn of tool calls only joins the assistant turn just before it
    (the Responses API gives every call an item of its own; OpenAI wants one assistant message
    holding the text and all its calls)."""
    last = messages[-1] if messages else None
    if (
        last is not None
        and last.role == "assistant"
        and m.role == "assistant"
        and m.tool_calls
        and m.content is None
    ):
        last.tool_calls = [*(last.tool_calls or []), *m.tool_calls]
    else:
        messages.append(m)


def copy_extras(src: VllmExtras, out: ChatBody) -> None:
    """vLLM's extras of an API's request onto the chat request, as sent (None stays unset)."""
    for name in EXTRAS:
        value = getattr(src, name)
        if value is not None:
            setattr(out, name, value)


def check_constraint(body: ChatBody, names: Names) -> None:
    """400 for two constraints on the translated request, or min_tokens with one, naming the
    fields as the client's API does (`names`); the chat path checks the same again, with
    OpenAI's names, and finds nothing."""
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    c = constraint(body, body.response_format, forced, names)
    refuse_min_tokens(c.field, body.min_tokens, names)
