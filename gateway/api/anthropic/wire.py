"""Anthropic Messages API bodies as the gateway's `/v1/messages` reads and writes them.

Requests are typed down to the content blocks (tagged unions on `type`), so a malformed body is
refused by the decoder with the path of what is wrong. `cache_control` on a tool, a system block
or a content block marks the end of a prefix to keep cached (gateway/serving/retain.py). Other
unknown fields inside blocks are ignored (clients add `citations`); unknown top-level fields are
checked by the handler.
The request takes vLLM's extras too (`VllmExtras`, sent through `extra_body`), as chat does.
Answers and stream events mirror Anthropic's shapes field for field, so the official
`anthropic` client parses them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.api.chat_body import VllmExtras
from protocol.retention import RetainTTL
from protocol.sse import named_sse
from protocol.thinking import Thinking

# -- requests -------------------------------------------------------------------------------


class CacheControl(msgspec.Struct, kw_only=True):
    """`{"type": "ephemeral", "ttl": "5m" | "1h"}`: keep the prompt up to here cached."""

    type: Literal["ephemeral"]
    ttl: RetainTTL = RetainTTL.FIVE_MINUTES


class Cacheable(msgspec.Struct, kw_only=True):
    cache_control: CacheControl | None = None


class TextBlock(Cacheable, kw_only=True, tag="text", tag_field="type"):
    text: str


class ImageSource(msgspec.Struct, kw_only=True):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(Cacheable, kw_only=True, tag="image", tag_field="type"):
    source: ImageSource


class ToolUseBlock(Cacheable, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    #: the tool's input: a JSON object shaped by the tool's own schema
    input: dict[str, Any]


class ToolResultBlock(Cacheable, kw_only=True, tag="tool_result", tag_field="type"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False


class ThinkingOut(msgspec.Struct, kw_only=True, tag="thinking", tag_field="type"):
    """A reasoning block as the provider's model signed it (the client sends it back as is)."""

    thinking: str
    signature: str


class RedactedThinkingOut(msgspec.Struct, kw_only=True, tag="redacted_thinking", tag_field="type"):
    data: str


Block = (
    TextBlock
    | ImageBlock
    | ToolUseBlock
    | ToolResultBlock
    | ThinkingOut  # an earlier answer's reasoning, sent back in its assistant turn
    | RedactedThinkingOut
)


class InputMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class InputTool(Cacheable, kw_only=True):
    name: str
    #: the tool's JSON Schema, as the client wrote it
    input_schema: dict[str, Any]
    description: str | None = None
    #: custom tools only (Anthropic's server tools, e.g. web_search, are not served here)
    type: Literal["custom"] | None = None


class ChoiceAuto(msgspec.Struct, kw_only=True, tag="auto", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ChoiceAny(msgspec.Struct, kw_only=True, tag="any", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


class ChoiceTool(msgspec.Struct, kw_only=True, tag="tool", tag_field="type"):
    name: str
    disable_parallel_tool_use: bool | None = None


class ChoiceNone(msgspec.Struct, kw_only=True, tag="none", tag_field="type"):
    disable_parallel_tool_use: bool | None = None


ToolChoice = ChoiceAuto | ChoiceAny | ChoiceTool | ChoiceNone


class JSONOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    #: a JSON Schema, as the client wrote it
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    """`output_config`: a JSON schema the answer must follow; `effort` (a thinking hint for
    Claude models) is accepted and has no effect here."""

    format: JSONOutputFormat | None = None
    effort: str | None = None


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None


class MessagesRequest(VllmExtras, kw_only=True):
    """The body. temperature, top_p and top_k are the older API's (recent SDKs send them
    through `extra_body`); they still steer the self-hosted and OpenAI-compatible models.
    vLLM's extras (guided_choice, structured_outputs, min_p, …) are inherited:
    gateway/api/chat_body.py."""

    model: str
    messages: list[InputMessage]
    max_tokens: int
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: Anthropic's own (also one of vLLM's extras; Anthropic's range: a positive integer)
    top_k: int | None = None
    stream: bool = False
    tools: list[InputTool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    #: Anthropic's own tier names (auto | standard_only): accepted, the gateway's tiers decide
    service_tier: str | None = None
    #: extended thinking: passed to an Anthropic provider's model that lists the `thinking`
    #: feature, refused (400) for any other (surface.py)
    thinking: Thinking | None = None


#: the top-level fields the handler accepts (others are refused by name unless neutral)
FIELDS = frozenset(MessagesRequest.__struct_fields__)

# -- answers --------------------------------------------------------------------------------


class TextOut(msgspec.Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ToolUseOut(msgspec.Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


#: a block of an answer
OutBlock = ThinkingOut | RedactedThinkingOut | TextOut | ToolUseOut


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class Message(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[OutBlock]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class ErrorObject(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorBody(msgspec.Struct, kw_only=True, tag="error", tag_field="type"):
    """`{"type": "error", "error": {"type", "message"}}`: the body of an error answer, and the
    data of a stream's `error` event."""

    error: ErrorObject


# -- stream events --------------------------------------------------------------------------


class MessageStart(msgspec.Struct, kw_only=True, tag="message_start", tag_field="type"):
    message: Message


class BlockStart(msgspec.Struct, kw_only=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: OutBlock


class TextDelta(msgspec.Struct, kw_only=True, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(msgspec.Struct, kw_only=True, tag="signature_delta", tag_field="type"):
    signature: str


class BlockDelta(msgspec.Struct, kw_only=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta | ThinkingDelta | SignatureDelta


class BlockStop(msgspec.Struct, kw_only=True, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None = None


class MessageDelta(msgspec.Struct, kw_only=True, tag="message_delta", tag_field="type"):
    delta: StopInfo
    #: cumulative; carries the final input counts too (known only once the answer ended)
    usage: Usage


class MessageStop(msgspec.Struct, kw_only=True, tag="message_stop", tag_field="type"):
    pass


class Ping(msgspec.Struct, kw_only=True, tag="ping", tag_field="type"):
    pass


StreamEvent = (
    MessageStart
    | BlockStart
    | BlockDelta
    | BlockStop
    | MessageDelta
    | MessageStop
    | Ping
    | ErrorBody
)


def sse(event: StreamEvent) -> bytes:
    """One event as Anthropic sends it: `event: <type>` and `data: <json>`."""
    return named_sse(event)


class TokenCount(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /v1/messages/count_tokens`'s answer."""

    input_tokens: int
