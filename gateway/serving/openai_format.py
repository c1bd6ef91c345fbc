"""OpenAI response shapes for both endpoints: stream chunks and whole bodies.

One `Formatter` per request knows the id, model, creation time and endpoint, so every chunk
of a stream agrees on them (clients check).
"""

from __future__ import annotations

import time

import msgspec

from gateway.backends.base import Piece
from gateway.serving.reasoning import Reasoning
from protocol.chat import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    chat_logprobs,
)
from protocol.openai import CompletionLogprobs, Usage, merge_logprobs
from protocol.sse import sse
from protocol.tools import FunctionCall, ToolCall, ToolCallDelta


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class TokenIdsChoice(CompletionChoice, kw_only=True):
    """A completion choice with the ids of its tokens and, whole or in a stream's first chunk
    of the choice, the prompt's (vLLM's `return_token_ids`)."""

    token_ids: list[int]
    prompt_token_ids: list[int] | None = None


class TokenIdsChatChoice(ChatChoice, kw_only=True):
    """A chat choice with the ids of its tokens (vLLM's `return_token_ids`)."""

    token_ids: list[int]


class TokenIdsChunkChoice(ChatChunkChoice, kw_only=True):
    token_ids: list[int]


class ChatCompletionIds(ChatCompletion, kw_only=True):
    """A chat answer with its prompt's token ids (vLLM's `return_token_ids`)."""

    prompt_token_ids: list[int]


class ChatChunkIds(ChatCompletionChunk, kw_only=True):
    """A chat stream's first chunk with the prompt's token ids (vLLM's `return_token_ids`)."""

    prompt_token_ids: list[int]


class CompletionResponse(msgspec.Struct, kw_only=True):
    """OpenAI's text_completion (the node's struct omits defaults, `object` included)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


def usage(prompt: int, completion: int, cached: int, written: int = 0) -> Usage:
    """OpenAI's usage; `written`: prompt tokens written to a cache the client asked for (its
    `cache_control`), said as `prompt_tokens_details.cache_write_tokens` only when there are any
    (OpenAI has no such field; the Messages API reports them as `cache_creation_input_tokens`)."""
    details = {"cached_tokens": cached}
    if written:
        details["cache_write_tokens"] = written
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=details,
    )


class Formatter:
    def __init__(
        self,
        endpoint: str,
        request_id: str,
        model: str,
        tier: str,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.endpoint = endpoint
        #: the answer carries its tokens' ids and these, the prompt's (vLLM's `return_token_ids`;
        #: None: not asked)
        self.prompt_ids = prompt_ids
        self.token_ids = prompt_ids is not None
        self.id = ("chatcmpl-" if endpoint == "chat" else "cmpl-") + request_id.removeprefix("req-")
        self.model = model
        self.created = int(time.time())
        self.tier = tier
        self._started: set[int] = set()
        #: a whole chat answer's reasoning, gathered from its pieces (`reasoned`)
        self._reasoning = Reasoning()

    def reasoned(self, p: Piece) -> None:
        """A piece of a whole answer: its reasoning kept for the answer's message."""
        self._reasoning.add(p)

    def chunk(self, p: Piece) -> bytes:
        first = p.index not in self._started
        if first:
            self._started.add(p.index)
        if self.endpoint == "chat":
            return self._chat_chunk(p, first)
        if self.token_ids:
            choice = self._completion_choice(
                p.index, p.text, p.finish_reason, p.logprobs, p.token_ids, first
            )
        else:  # the common case, once per token: no second call
            choice = CompletionChoice(
                index=p.index, text=p.text, finish_reason=p.finish_reason, logprobs=p.logprobs
            )
        return sse(
            CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice])
        )

    def _chat_chunk(self, p: Piece, first: bool) -> bytes:
        # the first opens with the role; a tool-call or reasoning delta carries no content
        # (OpenAI's shape, vLLM's)
        other = p.tool_calls or p.finish_reason or p.reasoning or p.thinking
        delta = ChatDelta(
            role="assistant" if first else None,
            content=p.text if p.text or not other else None,
            tool_calls=p.tool_calls,
            reasoning_content=p.reasoning or None,
            thinking_blocks=p.thinking,
        )
        choice = ChatChunkChoice(
            index=p.index, delta=delta, finish_reason=p.finish_reason, logprobs=_chat(p.logprobs)
        )
        if self.token_ids:
            choice = TokenIdsChunkChoice(**msgspec.structs.asdict(choice), token_ids=p.token_ids)
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            service_tier=self.tier,
            choices=[choice],
        )
        if first and p.index == 0 and self.prompt_ids is not None:
            chunk = ChatChunkIds(**msgspec.structs.asdict(chunk), prompt_token_ids=self.prompt_ids)
        return sse(chunk)

    def _completion_choice(
        self,
        index: int,
        text: str,
        finish: str | None,
        lp: CompletionLogprobs | None,
        ids: list[int],
        first: bool,
    ) -> CompletionChoice:
        """A completions choice; with token ids asked, its ids, and the prompt's on its first."""
        c = CompletionChoice(index=index, text=text, finish_reason=finish, logprobs=lp)
        if not self.token_ids:
            return c
        prompt = self.prompt_ids if first else None
        return TokenIdsChoice(**msgspec.structs.asdict(c), token_ids=ids, prompt_token_ids=prompt)

    def usage_chunk(self, u: Usage) -> bytes:
        if self.endpoint == "chat":
            return sse(
                ChatCompletionChunk(
                    id=self.id,
                    created=self.created,
                    model=self.model,
                    choices=[],
                    usage=u,
                    service_tier=self.tier,
                )
            )
        return sse(
            CompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[], usage=u
            )
        )

    def body(
        self,
        texts: dict[int, list[str]],
        finish: dict[int, str | None],
        u: Usage,
        logprobs: dict[int, list[CompletionLogprobs]] | None = None,
        calls: dict[int, list[ToolCallDelta]] | None = None,
        ids: dict[int, list[int]] | None = None,
    ) -> ChatCompletion | CompletionResponse:
        idx = sorted(texts)
        lps = {i: merge_logprobs(parts) for i, parts in (logprobs or {}).items()}
        if self.endpoint == "chat":
            return self._chat_body(texts, finish, u, lps, calls, ids or {})
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            usage=u,
            choices=[
                self._completion_choice(
                    i, "".join(texts[i]), finish.get(i), lps.get(i), (ids or {}).get(i, []), True
                )
                for i in idx
            ],
        )

    def _chat_body(
        self,
        texts: dict[int, list[str]],
        finish: dict[int, str | None],
        u: Usage,
        lps: dict[int, CompletionLogprobs],
        calls: dict[int, list[ToolCallDelta]] | None,
        ids: dict[int, list[int]],
    ) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i,
                message=self._reasoning.message(
                    i, _message("".join(texts[i]), (calls or {}).get(i))
                ),
                finish_reason=finish.get(i),
                logprobs=_chat(lps.get(i)),
            )
            for i in sorted(texts)
        ]
        out = ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            usage=u,
            service_tier=self.tier,
            choices=choices,
        )
        if self.prompt_ids is None:
            return out
        out.choices = [
            TokenIdsChatChoice(**msgspec.structs.asdict(c), token_ids=ids.get(c.index, []))
            for c in choices
        ]
        return ChatCompletionIds(**msgspec.structs.asdict(out), prompt_token_ids=self.prompt_ids)


def _chat(lp: CompletionLogprobs | None) -> ChatLogprobs | None:
    return None if lp is None else chat_logprobs(lp)


def _message(text: str, deltas: list[ToolCallDelta] | None) -> ChatMessageOut:
    """A choice's message: its text, and the calls its deltas make up (content null when the
    answer is only calls, as OpenAI sends it)."""
    if not deltas:
        return ChatMessageOut(content=text)
    calls: list[ToolCall] = []
    for d in deltas:
        if d.index == len(calls):
            calls.append(ToolCall(id=d.id or "", function=FunctionCall(name="", arguments="")))
        f = calls[d.index].function
        if d.function is not None:
            f.name = d.function.name or f.name
            f.arguments += d.function.arguments or ""
    return ChatMessageOut(content=text if text.strip() else None, tool_calls=calls)
