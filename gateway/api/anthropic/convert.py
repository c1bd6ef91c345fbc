"""Anthropic Messages ↔ OpenAI chat, for `/v1/messages` (api.py says the mapping): the request
into the typed chat request the pipeline serves (`to_chat`), a whole chat answer back into a
Message (`to_message`). The stream's way back is stream.py's.
"""

from __future__ import annotations

import json

import msgspec
from msgspec.structs import replace

from gateway.api.anthropic.cache_marks import retain_mark
from gateway.api.anthropic.wire import (
    Block,
    ChoiceTool,
    ImageBlock,
    Message,
    MessagesRequest,
    OutBlock,
    RedactedThinkingOut,
    TextBlock,
    TextOut,
    ThinkingOut,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
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
from gateway.backends.providers.anthropic_shapes import (
    FINISH_REASONS,
    TOOL_CHOICES_BACK,
    input_tokens,
)
from gateway.serving.constraint import Names
from protocol.chat import ChatCompletionRequest, ChatMessage, ThinkingBlock
from protocol.openai import APIError, StreamOptions
from protocol.structured import JSONSchemaFormat, ResponseFormat
from protocol.tools import (
    FunctionCall,
    FunctionDef,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
    ToolDef,
)

#: how this API calls the constraints of its own, in a 400 about two constraints
NAMES = Names(
    response_format="output_config.format", forced_tool="a forced tool_choice (any or a named tool)"
)


def _image(b: ImageBlock) -> Part:
    s = b.source
    if s.type == "base64":
        if not s.media_type or not s.data:
            raise APIError(400, "image source: base64 images need media_type and data")
        return image_part(f"data:{s.media_type};base64,{s.data}")
    if not s.url:
        raise APIError(400, "image source: url images need a url")
    return image_part(s.url)


def _parts(blocks: list[TextBlock | ImageBlock]) -> str | list[Part]:
    texts = [b for b in blocks if isinstance(b, TextBlock)]
    if len(texts) == len(blocks):
        return "".join(b.text for b in texts)
    return [text_part(b.text) if isinstance(b, TextBlock) else _image(b) for b in blocks]


def _result_text(b: ToolResultBlock) -> str | list[Part]:
    content = b.content if b.content is not None else ""
    out = content if isinstance(content, str) else _parts(content)
    if b.is_error and isinstance(out, str):
        return f"Error: {out}"  # OpenAI's tool message has no error flag: the model reads it
    return out


def _turn(role: str, content: str | list[Block], out: list[ChatMessage]) -> None:
    if isinstance(content, str):
        append(out, ChatMessage(role=role, content=content))
        return
    parts: list[TextBlock | ImageBlock] = []
    calls: list[ToolCall] = []
    thought: list[ThinkingBlock] = []
    results = 0
    for b in content:
        if isinstance(b, ThinkingOut | RedactedThinkingOut):
            if role != "assistant":
                raise APIError(400, f"{_kind(b)} blocks belong in an assistant turn")
            thought.append(msgspec.convert(msgspec.to_builtins(b), ThinkingBlock))
        elif isinstance(b, ToolResultBlock):
            results += 1
            if role != "user":
                raise APIError(400, "tool_result blocks belong in a user turn")
            out.append(
                ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=_result_text(b))
            )
        elif isinstance(b, ToolUseBlock):
            if role != "assistant":
                raise APIError(400, "tool_use blocks belong in an assistant turn")
            calls.append(
                ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
            )
        else:
            parts.append(b)
    blocks = thought or None
    if parts or not (calls or results):
        m = ChatMessage(role=role, content=_parts(parts), tool_calls=calls or None)
        append(out, replace(m, thinking_blocks=blocks))
    elif calls:
        append(out, ChatMessage(role="assistant", tool_calls=calls, thinking_blocks=blocks))


def _kind(b: ThinkingOut | RedactedThinkingOut) -> str:
    return "thinking" if isinstance(b, ThinkingOut) else "redacted_thinking"


def to_chat(body: MessagesRequest) -> TranslatedChat:
    """The Anthropic request as the chat request it is served as (see api.py's mapping)."""
    messages: list[ChatMessage] = []
    if body.system is not None:
        system = (
            body.system if isinstance(body.system, str) else "".join(b.text for b in body.system)
        )
        if system:
            messages.append(ChatMessage(role="system", content=system))
    system_end, turn_ends = len(messages), []
    for m in body.messages:
        _turn(m.role, m.content, messages)
        turn_ends.append(len(messages))
    out = ChatCompletionRequest(
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
        out.stream, out.stream_options = True, StreamOptions(include_usage=True)
    if body.tools:
        out.tools = [
            ToolDef(
                type="function",
                function=FunctionDef(
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
        if isinstance(tc, ChoiceTool):
            out.tool_choice = NamedToolChoice(type="function", function=NamedFunction(name=tc.name))
        else:
            out.tool_choice = TOOL_CHOICES_BACK[str(type(tc).__struct_config__.tag)]
        if tc.disable_parallel_tool_use:
            out.parallel_tool_calls = False
    copy_extras(body, out)
    out.top_k = body.top_k  # Anthropic's own field
    check_constraint(out, body, NAMES)
    thinking = body.thinking if body.thinking is not None and body.thinking.on else None
    return TranslatedChat(out, body, retain_mark(body, system_end, turn_ends), thinking)


def usage_of(u: TokenCounts) -> Usage:
    """Anthropic's split of the prompt: read from the cache, written to it (the marked prefix's
    tokens not read), and the rest (`input_tokens`); the three add up to the prompt."""
    fresh, cached = input_tokens(u.prompt_tokens, u.cached_tokens)
    written = min(max(u.cache_write_tokens, 0), fresh)
    return Usage(
        input_tokens=fresh - written,
        output_tokens=u.completion_tokens,
        cache_creation_input_tokens=written,
        cache_read_input_tokens=cached,
    )


def tool_input(arguments: str) -> dict[str, object]:
    """A tool call's arguments as a `tool_use` block's `input`, which Anthropic types as an
    object: a JSON object as it is, none as `{}`, and anything else — other JSON (a string, a
    number, a list) or text that is no JSON — wrapped as `{"value": …}` (the JSON value, else the
    text), so a called tool always reaches the client as a `tool_use` block."""
    if not arguments.strip():
        return {}
    try:
        v = json.loads(arguments)
    except ValueError:
        return {"value": arguments}
    return v if isinstance(v, dict) else {"value": v}


def thinking_out(b: ThinkingBlock) -> ThinkingOut | RedactedThinkingOut:
    """A reasoning block of the chat answer as the Messages API's block."""
    if b.type == "redacted_thinking":
        return RedactedThinkingOut(data=b.data or "")
    return ThinkingOut(thinking=b.thinking or "", signature=b.signature or "")


def to_message(a: ChatAnswer, msg_id: str, model: str) -> Message:
    content: list[OutBlock] = [
        ToolUseOut(id=c.id, name=c.name, input=tool_input(c.arguments)) for c in a.tool_calls
    ]
    text = a.text
    if text or not content:
        content.insert(0, TextOut(text=text))
    content[:0] = [thinking_out(b) for b in a.thinking]  # the reasoning comes first
    stop = FINISH_REASONS.get(a.finish_reason or "stop", "end_turn")
    if stop == "tool_use" and not any(isinstance(b, ToolUseOut) for b in content):
        stop = "end_turn"
    return Message(
        id=msg_id, model=model, content=content, stop_reason=stop, usage=usage_of(a.usage)
    )
