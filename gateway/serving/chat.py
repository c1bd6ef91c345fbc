"""The chat request: `parse_chat` reads a `/v1/chat/completions` body (the raw JSON: unknown
fields refused by name, types by msgspec), `check_chat` checks a typed
`ChatCompletionRequest` — what `parse_chat` decodes and what the translated APIs (Anthropic
Messages, Responses) build — into the pipeline's `Request`: the messages, the sampling ranges
(protocol/limits.py), tools, and the one constraint of the answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec

from gateway.serving.constraint import VllmFields, constraint, refuse_min_tokens
from gateway.serving.raw_body import convert, decode_json, refuse_unsupported, vllm_fields
from gateway.serving.requests import (
    CHAT_FIELDS,
    CHAT_ROLES,
    MAX_MESSAGES,
    Endpoint,
    Request,
    check_top,
    flag,
    sampling_of,
    user_of,
)
from gateway.tools.spec import check_tools, tool_turn
from protocol.chat import ChatCompletionRequest, ChatMessage
from protocol.openai import APIError
from protocol.thinking import Thinking


def parse_chat(raw: bytes) -> Request:
    """A `/v1/chat/completions` body, parsed and checked."""
    data = decode_json(raw)
    refuse_unsupported(data, CHAT_FIELDS)
    if "messages" not in data or "model" not in data:
        missing = "model" if "model" not in data else "messages"
        raise APIError(400, f"missing required field: {missing}", param=missing)
    body: ChatCompletionRequest = convert(data, ChatCompletionRequest)
    req = _check(body, lambda: vllm_fields(data))
    if data.get("thinking") is not None:
        # Anthropic's extended thinking, as LiteLLM takes it on chat: for a provider's model
        # that reasons (features.py refuses it elsewhere); "disabled" is no thinking
        thinking = _thinking(data["thinking"])
        req = replace(req, thinking=thinking if thinking.on else None)
    # vLLM's return_token_ids: the answer carries the prompt's and each choice's token ids
    return replace(req, return_token_ids=True) if flag(data, "return_token_ids") else req


def _thinking(raw: object) -> Thinking:
    try:
        return msgspec.convert(raw, Thinking)
    except msgspec.ValidationError as e:
        raise APIError(400, f"invalid thinking: {e}", param="thinking") from None


def check_chat(body: ChatCompletionRequest, vllm: VllmFields) -> Request:
    """A typed chat request, checked as a client's is (`vllm`: its vLLM extras)."""
    return _check(body, lambda: vllm)


def _check(body: ChatCompletionRequest, vllm: Callable[[], VllmFields]) -> Request:
    """`vllm` is read last: its 400 comes after those of the fields checked before it."""
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    if len(body.messages) > MAX_MESSAGES:  # before any template or tokenizer work on them
        raise APIError(
            400,
            f"messages holds at most {MAX_MESSAGES} messages, got {len(body.messages)}",
            param="messages",
        )
    messages = _messages(body.messages)
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        check_top("top_logprobs", body.top_logprobs)
    # the nodes speak the completions form: N top tokens besides the chosen one
    sampling, n = sampling_of(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    c = constraint(vllm(), body.response_format, forced_tool=tools.choice in ("required", "named"))
    refuse_min_tokens(c.field, sampling.min_tokens)
    return Request(
        endpoint=Endpoint.CHAT,
        model=body.model,
        messages=messages,
        prompt=None,
        max_tokens=max_tokens,
        sampling=sampling,
        n=n,
        stream=bool(body.stream),
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        service_tier=body.service_tier,
        user=user_of(body.user),
        response_format=body.response_format,
        guide=c.guide,
        open_guide=c.open_guide,
        structured_outputs=c.structured_outputs,
        constraint_field=c.field,
        guide_param=c.param,
        tools=tools,
        has_tool_turns=any("tool_calls" in m or m["role"] == "tool" for m in messages),
    )


def _messages(given: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages in OpenAI's form, content always a string (text parts joined; any other
    part is a 400), an assistant turn's `tool_calls` and a tool turn's `tool_call_id` kept."""
    messages = []
    for i, m in enumerate(given):
        if m.role not in CHAT_ROLES:
            raise APIError(
                400,
                f"messages[{i}]: role {m.role!r} is not supported (use system, developer, user, "
                "assistant or tool)",
                param=f"messages[{i}].role",
            )
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(
                        400,
                        f"messages[{i}]: content part of type {kind!r} is not supported "
                        "(only text)",
                        param=f"messages[{i}].content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        if m.tool_calls or m.role == "tool" or m.tool_call_id is not None:
            messages.append(_with_thought(i, m, tool_turn(i, m, content)))
            continue
        if content is None:
            raise APIError(
                400, f"messages[{i}]: content is required", param=f"messages[{i}].content"
            )
        role = "system" if m.role == "developer" else m.role
        messages.append(_with_thought(i, m, {"role": role, "content": content}))
    return messages


def _with_thought(i: int, m: ChatMessage, out: dict[str, Any]) -> dict[str, Any]:
    """`out` (message `i` in OpenAI's form) with the reasoning blocks an assistant turn carries
    back (an Anthropic model's, signed: its provider is sent them; others drop them)."""
    if m.thinking_blocks:
        if m.role != "assistant":
            raise APIError(
                400,
                f"messages[{i}]: thinking_blocks belong on an 'assistant' message",
                param=f"messages[{i}].thinking_blocks",
            )
        out["thinking_blocks"] = msgspec.to_builtins(m.thinking_blocks)
    return out
