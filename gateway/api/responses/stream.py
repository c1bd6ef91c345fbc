"""A chat stream's events as the Responses API's events, for a streamed `/v1/responses`:
response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta / .done,
response.function_call_arguments.delta / .done, response.output_item.done, and
response.completed — or response.incomplete when max_output_tokens cut the answer; an `error`
event for a failure after the stream opened.
"""

from __future__ import annotations

import time
from typing import TypeVar

import msgspec

from gateway.api.chat_answer import (
    ChatEvent,
    Done,
    Failed,
    Finish,
    Text,
    TokenCounts,
    ToolArgs,
    ToolStart,
    UsageSeen,
)
from gateway.api.responses.convert import finish, item_status, shell
from gateway.api.responses.wire import (
    ArgsDelta,
    ArgsDone,
    Completed,
    Created,
    Incomplete,
    InProgress,
    ItemAdded,
    ItemDone,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputTextPart,
    PartAdded,
    PartDone,
    ResponsesRequest,
    StreamError,
    StreamEvent,
    TextDelta,
    TextDone,
    sse,
)

_ENC = msgspec.json.Encoder()
_T = TypeVar("_T")


class ResponseStream:
    """Chat stream events → the Responses API's events (a `chat_answer.Renderer`)."""

    def __init__(self, rid: str, body: ResponsesRequest) -> None:
        self.rid, self.body = rid, body
        self.response = shell(rid, body, body.model, int(time.time()))
        self._seq = 0
        self._started = False
        self._open: OutputItem | None = None
        self._open_at = 0  # the open item's output index
        self._tool_item: dict[int, int] = {}  # tool call index → its output index
        self._finish: str | None = None
        self._usage = TokenCounts()
        self._failed = False

    def start(self, headers: dict[str, str]) -> None:
        self.response.model = headers.get("x-duet-model-used", self.response.model)

    def _n(self) -> int:
        self._seq += 1
        return self._seq - 1

    def _close(self, out: list[StreamEvent]) -> None:
        item, self._open, i = self._open, None, self._open_at
        if item is None:
            return
        status = item_status(self._finish)
        if isinstance(item, OutputMessage):
            part = item.content[0]
            out.append(
                TextDone(
                    sequence_number=self._n(),
                    item_id=item.id,
                    output_index=i,
                    content_index=0,
                    text=part.text,
                )
            )
            out.append(
                PartDone(
                    sequence_number=self._n(),
                    item_id=item.id,
                    output_index=i,
                    content_index=0,
                    part=part,
                )
            )
        else:
            out.append(
                ArgsDone(
                    sequence_number=self._n(),
                    item_id=item.id,
                    output_index=i,
                    name=item.name,
                    arguments=item.arguments,
                )
            )
        item.status = status
        out.append(ItemDone(sequence_number=self._n(), output_index=i, item=item))

    def _add(self, item: OutputItem, out: list[StreamEvent]) -> int:
        self._close(out)
        self._open = item
        self.response.output.append(item)
        i = self._open_at = len(self.response.output) - 1
        out.append(ItemAdded(sequence_number=self._n(), output_index=i, item=_copy(item)))
        return i

    def render(self, events: list[ChatEvent]) -> bytes:
        out: list[StreamEvent] = []
        for ev in events:
            if self._failed:
                break
            if not self._started and not isinstance(ev, Failed):
                self._started = True
                out.append(Created(sequence_number=self._n(), response=_copy(self.response)))
                out.append(InProgress(sequence_number=self._n(), response=_copy(self.response)))
            if isinstance(ev, Text):
                item = self._open
                if not isinstance(item, OutputMessage):
                    n = len(self.response.output)
                    item = OutputMessage(id=f"msg_{self.rid}_{n}", status="in_progress", content=[])
                    i = self._add(item, out)
                    item.content.append(OutputTextPart(text=""))
                    out.append(
                        PartAdded(
                            sequence_number=self._n(),
                            item_id=item.id,
                            output_index=i,
                            content_index=0,
                            part=OutputTextPart(text=""),
                        )
                    )
                part = item.content[0]
                part.text += ev.text
                out.append(
                    TextDelta(
                        sequence_number=self._n(),
                        item_id=item.id,
                        output_index=self._open_at,
                        content_index=0,
                        delta=ev.text,
                    )
                )
            elif isinstance(ev, ToolStart):
                fc = OutputFunctionCall(
                    id=f"fc_{self.rid}_{ev.index}",
                    call_id=ev.id,
                    name=ev.name,
                    arguments="",
                    status="in_progress",
                )
                self._tool_item[ev.index] = self._add(fc, out)
            elif isinstance(ev, ToolArgs):
                at = self._tool_item.get(ev.index)
                item = self.response.output[at] if at is not None else None
                if at is not None and isinstance(item, OutputFunctionCall):
                    item.arguments += ev.delta
                    out.append(
                        ArgsDelta(
                            sequence_number=self._n(),
                            item_id=item.id,
                            output_index=at,
                            delta=ev.delta,
                        )
                    )
            elif isinstance(ev, Finish):
                self._finish = ev.reason
                self._close(out)
            elif isinstance(ev, UsageSeen):
                self._usage = ev.usage
            elif isinstance(ev, Failed):
                self._failed = True
                code = ev.error.code if isinstance(ev.error.code, str) else None
                out.append(
                    StreamError(sequence_number=self._n(), message=ev.error.message, code=code)
                )
            elif isinstance(ev, Done):
                self._close(out)
                finish(self.response, self._finish, self._usage)
                done = Incomplete if self.response.status == "incomplete" else Completed
                out.append(done(sequence_number=self._n(), response=self.response))
        return b"".join(sse(e) for e in out)


def _copy(x: _T) -> _T:
    """A snapshot of `x` as it is now (the stream keeps changing the item and the response)."""
    return msgspec.json.decode(_ENC.encode(x), type=type(x))
