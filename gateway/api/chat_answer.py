"""The gateway's own OpenAI chat answer, read back: for APIs served by translation onto it.

`/v1/messages` (api/anthropic/) and `/v1/responses` (api/responses/) do not run a request path
of their own: they turn their request into an OpenAI chat request, run it through the one
pipeline (gateway/serving/pipeline.py) like any `/v1/chat/completions` call (auth, quotas, auto,
fallback, billing, every model), and translate the answer back. This module is the reading half
they share:
- `read_completion`: a whole chat answer (the Answer's body, a `ChatCompletion`) → `ChatAnswer`;
- `ChatEvents`: the bytes of an OpenAI SSE stream → typed events (text, a reasoning block's
  piece, a tool call opened, its argument pieces, the finish, the usage, an error, the end);
- `TranslatingSink`: an `EventSink` that reads the chat stream as it is written and writes what
  a `Renderer` makes of its events to the client's sink instead.

A stream is read in its wire form (the SSE bytes the chat path writes, as vLLM's own Anthropic
API reads its chat stream), so whatever the chat path learns to say (tool calls from self-hosted
models, new finish reasons) reaches both APIs as soon as it is on the wire. Invariant: a
renderer sees every event once and in order; the chunk that finishes a choice, the usage chunk
and `[DONE]` arrive in the sink's final `end` call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from gateway.serving.relay import EventSink
from protocol.chat import ChatCompletion, ChatMessageOut, ReasonedMessage, ThinkingBlock
from protocol.openai import ErrorDetail
from protocol.sse import DataLines


class _Function(msgspec.Struct, kw_only=True):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(msgspec.Struct, kw_only=True):
    index: int = 0
    id: str | None = None
    function: _Function | None = None


class _Message(msgspec.Struct, kw_only=True):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None
    thinking_blocks: list[ThinkingBlock] | None = None


class _Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: _Message | None = None
    delta: _Message | None = None
    finish_reason: str | None = None


class _Details(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class _Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Body(msgspec.Struct, kw_only=True):
    """A chat.completion or a chat.completion.chunk, or a stream's error event."""

    id: str = ""
    choices: list[_Choice] = []
    usage: _Usage | None = None
    error: ErrorDetail | None = None


_BODY = msgspec.json.Decoder(_Body)


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    name: str
    #: the arguments as the model wrote them (a JSON object's text)
    arguments: str


class TokenCounts(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    #: prompt tokens written to the cache the client asked for (its `cache_control`)
    cache_write_tokens: int = 0


def _counts(u: _Usage | None) -> TokenCounts:
    if u is None:
        return TokenCounts()
    d = u.prompt_tokens_details or _Details()
    return TokenCounts(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=d.cached_tokens,
        cache_write_tokens=d.cache_write_tokens,
    )


class ChatAnswer(msgspec.Struct, kw_only=True):
    """Choice 0 of a whole answer (the translated APIs have no n)."""

    id: str
    text: str
    tool_calls: list[ToolCall]
    finish_reason: str | None
    usage: TokenCounts
    #: the model's reasoning blocks (an Anthropic provider's, signed or redacted), in order
    thinking: list[ThinkingBlock] = []


def read_completion(body: object) -> ChatAnswer:
    """The Answer's body — the gateway's own `ChatCompletion` — read as choice 0's answer."""
    assert isinstance(body, ChatCompletion)  # the chat path's whole answer (openai_format.py)
    c = body.choices[0] if body.choices else None
    m = c.message if c is not None else ChatMessageOut()
    calls = [
        ToolCall(
            id=t.id or f"call_{i}",
            name=t.function.name or "",
            arguments=t.function.arguments or "{}",
        )
        for i, t in enumerate(m.tool_calls or [])
    ]
    u = body.usage
    details = (u.prompt_tokens_details or {}) if u is not None else {}
    usage = (
        TokenCounts(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_tokens=details.get("cached_tokens", 0),
            cache_write_tokens=details.get("cache_write_tokens", 0),
        )
        if u is not None
        else TokenCounts()
    )
    return ChatAnswer(
        id=body.id,
        text=m.content or "",
        tool_calls=calls,
        finish_reason=c.finish_reason if c is not None else None,
        usage=usage,
        thinking=(m.thinking_blocks or []) if isinstance(m, ReasonedMessage) else [],
    )


# -- streams --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Thought:
    """A piece of a reasoning block (protocol/chat.py `ThinkingBlock`: its text, its signature,
    or a redacted block whole)."""

    block: ThinkingBlock


@dataclass(frozen=True)
class ToolStart:
    """A tool call opens (its id and name come once, with its first piece)."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolArgs:
    index: int
    delta: str


@dataclass(frozen=True)
class Finish:
    reason: str


@dataclass(frozen=True)
class UsageSeen:
    usage: TokenCounts


@dataclass(frozen=True)
class Failed:
    error: ErrorDetail


@dataclass(frozen=True)
class Done:
    pass


ChatEvent = Text | Thought | ToolStart | ToolArgs | Finish | UsageSeen | Failed | Done


@dataclass
class ChatEvents:
    """OpenAI SSE bytes → ChatEvents, fed as they are written (choice 0 only)."""

    _lines: DataLines = field(default_factory=DataLines)
    _open: set[int] = field(default_factory=set)

    def feed(self, data: bytes) -> list[ChatEvent]:
        out: list[ChatEvent] = []
        for payload in self._lines.feed(data):
            if payload == b"[DONE]":
                out.append(Done())
                continue
            b = _BODY.decode(payload)
            if b.error is not None:
                out.append(Failed(b.error))
            for c in b.choices:
                if c.index != 0:
                    continue
                d = c.delta or _Message()
                out.extend(Thought(t) for t in d.thinking_blocks or ())
                if d.content:
                    out.append(Text(d.content))
                for t in d.tool_calls or []:
                    fn = t.function or _Function()
                    if t.index not in self._open:
                        self._open.add(t.index)
                        out.append(ToolStart(t.index, t.id or f"call_{t.index}", fn.name or ""))
                    if fn.arguments:
                        out.append(ToolArgs(t.index, fn.arguments))
                if c.finish_reason:
                    out.append(Finish(c.finish_reason))
            if b.usage is not None:
                out.append(UsageSeen(_counts(b.usage)))
        return out


class Renderer(Protocol):
    """Turns chat events into another API's stream bytes (stateful: one per request)."""

    def start(self, headers: dict[str, str]) -> None:
        """The answer's headers (the model used: `x-duet-model-used`), before any event."""

    def render(self, events: list[ChatEvent]) -> bytes: ...


class TranslatingSink:
    """An `EventSink` for the pipeline: reads the chat stream, writes `renderer`'s translation."""

    def __init__(
        self, inner: EventSink, renderer: Renderer, headers: dict[str, str] | None = None
    ) -> None:
        self.inner = inner
        self.renderer = renderer
        self.headers = headers or {}
        self._events = ChatEvents()

    @property
    def opened(self) -> bool:
        return self.inner.opened

    def could_wait(self, n: int) -> bool:
        return self.inner.could_wait(n)

    async def open(self, headers: dict[str, str]) -> None:
        self.renderer.start(headers)
        await self.inner.open({**headers, **self.headers})

    async def write(self, data: bytes) -> None:
        out = self.renderer.render(self._events.feed(data))
        if out:
            await self.inner.write(out)

    async def end(self, data: bytes) -> None:
        await self.inner.end(self.renderer.render(self._events.feed(data)))
