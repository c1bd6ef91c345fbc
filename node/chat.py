"""`POST /v1/chat/completions` on a node: the chat form of the node API, so routers written for
vLLM workers (vLLM's P/D proxy, llm-d, Dynamo-style frontends) drive duet nodes unchanged.

A chat body is the completion body with `messages` in place of `prompt`: the node applies the
model's chat template (off the event loop), then the request takes exactly the completion path —
the same validation, the same legs (`kv_transfer_params` on both legs, vLLM's names), the same
engine request. Only the answer's shape differs: `chat.completion` / `chat.completion.chunk`
(first delta carries the role; with `stream_options.include_usage` a last chunk with empty choices
carries usage), plus the node's extensions `kv_transfer_params` and `timing`.

Invariant: a chat request and a completion request whose prompt is the chat-templated token ids
produce the same tokens (greedy): the rendering is the only difference.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from node.engine_api import Delta
from node.request_body import decode_request
from protocol.chat import ChatChunkChoice, ChatDelta, ChatLogprobs, chat_logprobs
from protocol.kv_params import KVTransferParams
from protocol.limits import check_logprobs
from protocol.node_api import NodeCompletion, NodeCompletionRequest
from protocol.openai import APIError, CompletionLogprobs, SamplingFields, Usage, refusals
from text.tokenizer import ChatTemplateError, Tokenizer


class ContentPart(msgspec.Struct, kw_only=True):
    """One part of a message's content; only `{"type": "text", "text": ...}` is served (other
    kinds decode, so the refusal can name them)."""

    type: str
    text: str | None = None


class NodeChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart]
    name: str | None = None


class NodeChatRequest(SamplingFields, kw_only=True):
    """The chat body a node accepts: the sampling fields a completion takes (SamplingFields)
    plus the chat form's own; `kv_transfer_params` typed as on the completion leg."""

    # narrowed on purpose, as on NodeCompletionRequest (protocol/node_api.py)
    kv_transfer_params: KVTransferParams | None = None  # type: ignore[assignment]
    messages: list[NodeChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    add_generation_prompt: bool = True


_DEC = msgspec.json.Decoder(NodeChatRequest)
_ROLES = ("system", "user", "assistant", "developer")


def parse_chat(raw: bytes) -> NodeChatRequest:
    body = decode_request(_DEC, raw)
    if not body.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    for i, m in enumerate(body.messages):
        if m.role not in _ROLES:
            raise APIError(
                400,
                f"messages[{i}].role must be one of {', '.join(_ROLES)}, got {m.role!r}",
                param="messages",
            )
        if isinstance(m.content, list) and any(
            p.type != "text" or p.text is None for p in m.content
        ):
            raise APIError(
                400, f"messages[{i}].content: only text parts are supported", param="messages"
            )
    if body.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        with refusals():
            check_logprobs("top_logprobs", body.top_logprobs)
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise APIError(
            400, "give max_tokens or max_completion_tokens, not both", param="max_tokens"
        )
    return body


def _text(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text or "" for p in content)


def template(tokenizer: Tokenizer, body: NodeChatRequest) -> list[int]:
    """The chat-templated prompt's token ids (slow for long chats: call off the event loop)."""
    messages = [{"role": m.role, "content": _text(m.content)} for m in body.messages]
    try:
        return tokenizer.encode_chat(messages, add_generation_prompt=body.add_generation_prompt)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def as_completion(body: NodeChatRequest, prompt_ids: list[int]) -> NodeCompletionRequest:
    """The completion request the chat request means (its prompt already templated)."""
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    shared = {name: getattr(body, name) for name in SamplingFields.__struct_fields__}
    return NodeCompletionRequest(
        prompt=prompt_ids,
        max_tokens=16 if max_tokens is None else max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        **shared,
    )


class NodeChatMessageOut(msgspec.Struct, kw_only=True):
    role: str
    content: str


class NodeChatChoice(msgspec.Struct, kw_only=True):
    """A whole chat answer's choice (every key always present, as vLLM's)."""

    index: int
    message: NodeChatMessageOut
    finish_reason: str | None
    #: protocol.chat.chat_logprobs' object (OpenAI's chat logprobs)
    logprobs: ChatLogprobs | None
    stop_reason: str | int | None


class NodeChatCompletion(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # no default: omit_defaults would drop it
    created: int
    model: str
    choices: list[NodeChatChoice]
    usage: Usage | None = None
    kv_transfer_params: KVTransferParams | None = None
    timing: dict[str, float] | None = None


def chat_response(result: NodeCompletion) -> NodeChatCompletion:
    c = result.choices[0]
    choice = NodeChatChoice(
        index=0,
        message=NodeChatMessageOut(role="assistant", content=c.text),
        finish_reason=c.finish_reason,
        stop_reason=c.stop_reason,
        logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs),
    )
    return NodeChatCompletion(
        id=result.id,
        object="chat.completion",
        created=result.created,
        model=result.model,
        choices=[choice],
        usage=result.usage,
        kv_transfer_params=result.kv_transfer_params,
        timing=result.timing,
    )


class NodeChatChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str
    object: str  # no default: omit_defaults would drop it
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    timing: dict[str, float] | None = None


class ChatChunker:
    """Renders a stream's deltas as chat chunks (the first one carries the assistant role)."""

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())
        self._first = True

    def chunks(
        self,
        out: Delta,
        usage: Usage | None,
        timing: dict[str, float] | None,
        logprobs: CompletionLogprobs | None = None,
    ) -> list[NodeChatChunk]:
        delta = ChatDelta(role="assistant" if self._first else None, content=out.new_text)
        self._first = False
        lp = None if logprobs is None else chat_logprobs(logprobs)
        made = [
            NodeChatChunk(
                id=self.request_id,
                object="chat.completion.chunk",
                created=self.created,
                model=self.model,
                choices=[
                    ChatChunkChoice(
                        index=0, delta=delta, finish_reason=out.finish_reason, logprobs=lp
                    )
                ],
            )
        ]
        if out.finished and self.include_usage:
            made.append(
                NodeChatChunk(
                    id=self.request_id,
                    object="chat.completion.chunk",
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=usage,
                    timing=timing,
                )
            )
        elif out.finished:
            made[0].timing = timing
        return made
