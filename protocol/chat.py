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


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    #: a string, or a list of content parts ({"type": "text", "text": ...}); None for an
    #: assistant turn that only called tools (refused: tools are unsupported)
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


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


class ChatMessageOut(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatMessageOut
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


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


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


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


def _entry(token: str, logprob: float | None) -> dict[str, Any]:
    # OpenAI sends -9999.0 where a logprob is -inf (JSON has no infinity)
    lp = -9999.0 if logprob is None or logprob == float("-inf") else logprob
    return {"token": token, "logprob": lp, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(lp: CompletionLogprobs) -> dict[str, Any]:
    """A completions logprobs object in chat's shape: `{content: [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}` (tops most likely first, as sent)."""
    return {"content": [
        {**_entry(tok, v), "top_logprobs": [_entry(t, w) for t, w in (top or {}).items()]}
        for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True)
    ]}  # fmt: skip
