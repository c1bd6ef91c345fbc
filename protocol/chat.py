"""OpenAI `/v1/chat/completions` bodies, as the gateway accepts and answers them.

Requests are decoded leniently on types (msgspec) and checked for meaning by the gateway, which
also refuses fields it does not support by name (it sees the raw keys first). Responses and
stream chunks mirror OpenAI's shapes field for field, so the official clients parse them.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from protocol.openai import CompletionLogprobs, StreamOptions, Usage
from protocol.structured import ResponseFormat
from protocol.tools import ToolCall, ToolCallDelta, ToolChoice, ToolDef


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    #: a string, or a list of content parts ({"type": "text", "text": ...}); None for an
    #: assistant turn that only called tools
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    #: an assistant turn's calls; a `role: "tool"` turn answers one of them by its id
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    #: an assistant turn's reasoning blocks as the model signed them (an Anthropic model wants
    #: them back with its tool results); only an Anthropic provider is sent them
    thinking_blocks: list[ThinkingBlock] | None = None


class ChatCompletionRequest(msgspec.Struct, kw_only=True):
    model: str
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    service_tier: str | None = None
    # vLLM extensions, passed to the nodes under the same names
    top_k: int | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # penalties and biases (OpenAI's and vLLM's), structured outputs, tools
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None


class ThinkingBlock(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A model's reasoning as Anthropic's Messages API gives it, carried on chat's answer as
    `thinking_blocks` (LiteLLM's name for the same): `thinking` with its `signature`, or
    `redacted_thinking` with its encrypted `data`. In a stream a block comes in pieces: its
    text (`thinking`) in order, then its `signature`; a redacted block comes whole."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class ReasonedMessage(ChatMessageOut, kw_only=True):
    """An answer with the model's reasoning: its text as `reasoning_content` (vLLM's and
    DeepSeek's field) and, from a model that signs it (Anthropic's), its blocks whole."""

    reasoning_content: str | None = None
    thinking_blocks: list[ThinkingBlock] | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int = msgspec.field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    service_tier: str | None = None
    system_fingerprint: str | None = None


class ChatDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    #: the reasoning's text, and its blocks' pieces (`ReasonedMessage`'s fields, streamed)
    reasoning_content: str | None = None
    thinking_blocks: list[ThinkingBlock] | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    #: only on the last chunk when stream_options.include_usage (with choices == [])
    usage: Usage | None = None
    service_tier: str | None = None
    system_fingerprint: str | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    """One candidate token in chat's logprobs shape."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob, kw_only=True):
    """A sampled token in chat's logprobs shape, with the most likely tokens at its position."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    """Chat's logprobs object: `{content: [{token, logprob, bytes, top_logprobs}]}`."""

    content: list[ChatTokenLogprob]


def _lp(logprob: float | None) -> float:
    # OpenAI sends -9999.0 where a logprob is -inf (JSON has no infinity)
    return -9999.0 if logprob is None or logprob == float("-inf") else logprob


def chat_logprobs(lp: CompletionLogprobs) -> ChatLogprobs:
    """A completions logprobs object in chat's shape (tops most likely first, as sent)."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=tok,
                logprob=_lp(v),
                bytes=list(tok.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=t, logprob=_lp(w), bytes=list(t.encode("utf-8")))
                    for t, w in (top or {}).items()
                ],
            )
            for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
        ]
    )
