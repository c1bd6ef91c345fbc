"""OpenAI Responses API bodies as the gateway's `/v1/responses` reads and writes them.

Requests: `input` is a string or a list of items — messages (with or without `"type":
"message"`; content a string or input_text / output_text / input_image parts), `function_call`
and `function_call_output` — typed as tagged unions; function tools; tool_choice; `text.format`;
and vLLM's extras (`VllmExtras`, sent through `extra_body`), as chat takes them.
Answers: the `response` object with its `output` items (message with output_text parts,
function_call), its usage, and the stream events that build it (each with its
`sequence_number`). Field names and shapes are OpenAI's, so the official client parses them.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.api.chat_body import VllmExtras
from protocol.sse import named_sse

# -- requests -------------------------------------------------------------------------------


class InputText(msgspec.Struct, kw_only=True, tag="input_text", tag_field="type"):
    text: str


class OutputText(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    """Text of an earlier assistant answer sent back in `input`."""

    text: str


class InputImage(msgspec.Struct, kw_only=True, tag="input_image", tag_field="type"):
    image_url: str | None = None
    file_id: str | None = None


class MessageItem(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText | OutputText | InputImage]


class FunctionCallItem(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(
    msgspec.Struct, kw_only=True, tag="function_call_output", tag_field="type"
):
    call_id: str
    output: str | list[InputText | InputImage]


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(
    msgspec.Struct, kw_only=True, tag="function", tag_field="type", omit_defaults=True
):
    name: str
    #: the function's JSON Schema, as the client wrote it
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(msgspec.Struct, kw_only=True, tag="function", tag_field="type"):
    name: str


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`text.format`: text, json_object, or json_schema (name, schema, strict flat here)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat = msgspec.field(default_factory=TextFormat)


class ResponsesRequest(VllmExtras, kw_only=True):
    """The body; vLLM's extras (guided_choice, structured_outputs, top_k, min_p, …) are
    inherited (gateway/api/chat_body.py)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    #: accepted and answered as false: this gateway stores no responses
    store: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None


#: the top-level fields the handler accepts (others are refused by name unless neutral)
FIELDS = frozenset(ResponsesRequest.__struct_fields__) | {"include", "stream_options"}

# -- the response object --------------------------------------------------------------------


class OutputTextPart(msgspec.Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class OutputMessage(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputTextPart]


class OutputFunctionCall(msgspec.Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall


class InputDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputDetails
    output_tokens: int
    output_tokens_details: OutputDetails = msgspec.field(default_factory=OutputDetails)
    total_tokens: int


class IncompleteDetails(msgspec.Struct, kw_only=True):
    #: OpenAI's reasons, and Anthropic's `pause_turn` (a provider paused a long turn: the
    #: client sends the conversation again to continue it; OpenAI's API has no such stop)
    reason: Literal["max_output_tokens", "content_filter", "pause_turn"]


class Response(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    tools: list[FunctionTool] = []
    text: TextConfig = msgspec.field(default_factory=TextConfig)
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = {}
    user: str | None = None
    store: bool = False


# -- stream events --------------------------------------------------------------------------


class Created(msgspec.Struct, kw_only=True, tag="response.created", tag_field="type"):
    sequence_number: int
    response: Response


class InProgress(msgspec.Struct, kw_only=True, tag="response.in_progress", tag_field="type"):
    sequence_number: int
    response: Response


class Completed(msgspec.Struct, kw_only=True, tag="response.completed", tag_field="type"):
    sequence_number: int
    response: Response


class Incomplete(msgspec.Struct, kw_only=True, tag="response.incomplete", tag_field="type"):
    sequence_number: int
    response: Response


class ItemAdded(msgspec.Struct, kw_only=True, tag="response.output_item.added", tag_field="type"):
    sequence_number: int
    output_index: int
    item: OutputItem


class ItemDone(msgspec.Struct, kw_only=True, tag="response.output_item.done", tag_field="type"):
    sequence_number: int
    output_index: int
    item: OutputItem


class PartAdded(msgspec.Struct, kw_only=True, tag="response.content_part.added", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputTextPart


class PartDone(msgspec.Struct, kw_only=True, tag="response.content_part.done", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputTextPart


class TextDelta(msgspec.Struct, kw_only=True, tag="response.output_text.delta", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = []


class TextDone(msgspec.Struct, kw_only=True, tag="response.output_text.done", tag_field="type"):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = []


class ArgsDelta(
    msgspec.Struct, kw_only=True, tag="response.function_call_arguments.delta", tag_field="type"
):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgsDone(
    msgspec.Struct, kw_only=True, tag="response.function_call_arguments.done", tag_field="type"
):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class StreamError(msgspec.Struct, kw_only=True, tag="error", tag_field="type"):
    sequence_number: int
    message: str
    code: str | None = None
    param: str | None = None


StreamEvent = (
    Created
    | InProgress
    | Completed
    | Incomplete
    | ItemAdded
    | ItemDone
    | PartAdded
    | PartDone
    | TextDelta
    | TextDone
    | ArgsDelta
    | ArgsDone
    | StreamError
)


def sse(event: StreamEvent) -> bytes:
    """One event as OpenAI sends it: `event: <type>` and `data: <json>`."""
    return named_sse(event)
