"""A chat stream's events as Anthropic's event sequence, for a streamed `/v1/messages`:
message_start, content_block_start / _delta / _stop per block, message_delta with the stop
reason and the usage, message_stop; an `error` event for a failure after the stream opened.

A reasoning block streams as the provider streamed it (`thinking_delta`s, then its
`signature_delta`; a redacted block whole in its start). A tool call's arguments that begin
as a JSON object stream as they come (`input_json_delta`); others (convert.py `tool_input`
wraps them as `{"value": …}`) are held and sent as one delta when their block closes, so the
streamed `input` is the whole answer's.
"""

from __future__ import annotations

import json

from gateway.api.anthropic.convert import tool_input, usage_of
from gateway.api.anthropic.wire import (
    BlockDelta,
    BlockStart,
    BlockStop,
    ErrorBody,
    ErrorObject,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    OutBlock,
    RedactedThinkingOut,
    SignatureDelta,
    StopInfo,
    StreamEvent,
    TextDelta,
    TextOut,
    ThinkingDelta,
    ThinkingOut,
    ToolUseOut,
    Usage,
    sse,
)
from gateway.api.chat_answer import (
    ChatEvent,
    Done,
    Failed,
    Finish,
    Text,
    Thought,
    TokenCounts,
    ToolArgs,
    ToolStart,
    UsageSeen,
)
from gateway.backends.providers.anthropic_shapes import FINISH_REASONS, error_type_named
from protocol.chat import ThinkingBlock


class MessageStream:
    """Chat stream events → Anthropic's event sequence (a `chat_answer.Renderer`)."""

    def __init__(self, msg_id: str, model: str) -> None:
        self.msg_id, self.model = msg_id, model
        self._started = False
        self._block: int | None = None  # the open block's index
        self._text_open = False
        #: the open block is a thinking block whose signature (its last piece) has not come
        self._thinking_open = False
        self._blocks = 0
        self._tool_block: dict[int, int] = {}  # tool call index → its block
        self._held: dict[int, str] = {}  # a tool block → its arguments, not yet known an object
        self._passing: set[int] = set()  # the tool blocks whose arguments are an object's text
        self._stop = "end_turn"
        self._usage = TokenCounts()
        self._failed = False

    def start(self, headers: dict[str, str]) -> None:
        self.model = headers.get("x-duet-model-used", self.model)

    def _close(self, out: list[StreamEvent]) -> None:
        if self._block is not None and self._block in self._held:
            wrapped = tool_input(self._held.pop(self._block))
            if wrapped:
                out.append(
                    BlockDelta(
                        index=self._block, delta=InputJsonDelta(partial_json=json.dumps(wrapped))
                    )
                )
        if self._block is not None:
            out.append(BlockStop(index=self._block))
            self._block, self._text_open, self._thinking_open = None, False, False

    def _open(self, block: OutBlock, out: list[StreamEvent]) -> int:
        self._close(out)
        self._block, self._blocks = self._blocks, self._blocks + 1
        out.append(BlockStart(index=self._block, content_block=block))
        return self._block

    def _args(self, block: int, delta: str, out: list[StreamEvent]) -> None:
        """A piece of a tool block's arguments: streamed once they show an object's `{`."""
        if block not in self._passing:
            held = self._held.pop(block, "") + delta
            if not held.lstrip().startswith("{"):
                self._held[block] = held  # whitespace so far, or no object: `_close` sends it
                return
            self._passing.add(block)
            delta = held
        out.append(BlockDelta(index=block, delta=InputJsonDelta(partial_json=delta)))

    def _thought(self, b: ThinkingBlock, out: list[StreamEvent]) -> None:
        """A reasoning block's piece: its text continues the open thinking block (or opens
        one), its signature ends it; a redacted block is a block of its own, whole."""
        if b.type == "redacted_thinking":
            self._open(RedactedThinkingOut(data=b.data or ""), out)
            return
        if not self._thinking_open:
            self._open(ThinkingOut(thinking="", signature=""), out)
            self._thinking_open = True
        at = self._block or 0
        if b.thinking:
            out.append(BlockDelta(index=at, delta=ThinkingDelta(thinking=b.thinking)))
        if b.signature is not None:
            out.append(BlockDelta(index=at, delta=SignatureDelta(signature=b.signature)))
            self._thinking_open = False  # signed: the next piece of reasoning is a new block

    def render(self, events: list[ChatEvent]) -> bytes:
        out: list[StreamEvent] = []
        for ev in events:
            if self._failed:
                break
            if not self._started and not isinstance(ev, Failed):
                self._started = True
                out.append(
                    MessageStart(
                        message=Message(
                            id=self.msg_id,
                            model=self.model,
                            content=[],
                            usage=Usage(input_tokens=0, output_tokens=0),
                        )
                    )
                )
            if isinstance(ev, Thought):
                self._thought(ev.block, out)
            elif isinstance(ev, Text):
                if not self._text_open:
                    self._open(TextOut(text=""), out)
                    self._text_open = True
                out.append(BlockDelta(index=self._block or 0, delta=TextDelta(text=ev.text)))
            elif isinstance(ev, ToolStart):
                self._tool_block[ev.index] = self._open(
                    ToolUseOut(id=ev.id, name=ev.name, input={}), out
                )
            elif isinstance(ev, ToolArgs):
                self._args(self._tool_block.get(ev.index, self._block or 0), ev.delta, out)
            elif isinstance(ev, Finish):
                self._close(out)
                self._stop = FINISH_REASONS.get(ev.reason, "end_turn")
            elif isinstance(ev, UsageSeen):
                self._usage = ev.usage
            elif isinstance(ev, Failed):
                self._failed = True
                status = ev.error.code if isinstance(ev.error.code, int) else None
                etype = error_type_named(ev.error.type, status)
                out.append(ErrorBody(error=ErrorObject(type=etype, message=ev.error.message)))
            elif isinstance(ev, Done):
                self._close(out)
                out.append(
                    MessageDelta(
                        delta=StopInfo(stop_reason=self._stop), usage=usage_of(self._usage)
                    )
                )
                out.append(MessageStop())
        return b"".join(sse(e) for e in out)
