"""The OpenAI chat request that `/v1/messages` and `/v1/responses` are translated into.

Both APIs run on the gateway's chat path (see chat_answer.py): they build a `ChatBody` and hand
its JSON to `serve.run`, which parses and checks it as it checks any client's. The tool shapes
are protocol/tools.py's (re-exported here for the two translators). Every field is
omitted when unset (`omit_defaults`), so a request that uses no tools carries no `tools` key
and is served by every model the chat path serves.
"""

from __future__ import annotations

from typing import Literal

import msgspec

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


class ChatBody(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    messages: list[Message]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    service_tier: str | None = None


__all__ = ["ChatBody", "FunctionCall", "FunctionDef", "ImagePart", "ImageURL", "Message", "NamedFunction",
           "NamedToolChoice", "StreamOptions", "TextPart", "ToolCall", "ToolDef", "append", "encode"]
_ENC = msgspec.json.Encoder()


def encode(body: ChatBody) -> bytes:
    return _ENC.encode(body)


def append(messages: list[Message], m: Message) -> None:
    """Add `m`; an assistant turn of tool calls only joins the assistant turn just before it
    (the Responses API gives every call an item of its own; OpenAI wants one assistant message
    holding the text and all its calls)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and m.role == "assistant" and m.tool_calls and m.content is None:
        last.tool_calls = [*(last.tool_calls or []), *m.tool_calls]
    else:
        messages.append(m)
