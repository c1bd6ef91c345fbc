"""A self-hosted model's reply with its tool calls parsed: the text pieces of each choice go
through the plan's parser, and come out as content pieces and `tool_calls` deltas in OpenAI's
stream shape (the first delta of a call: index, id, type, function.name and arguments "";
then function.arguments fragments). A choice that made a call and stopped finishes with
`tool_calls`; one cut by max_tokens keeps `length`.

The reply's accounting is the wrapped reply's own (the tokens are what the model made,
whatever the parser shows of them); closing this reply closes it. The tokens of text the
parser holds back go with the next piece it emits (`Piece.tokens`): an answer that breaks off
before that piece does not bill them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

from gateway.backends.base import Accounting, Piece, Reply
from gateway.tools.events import CallArgs, CallStart, Event, Text, ToolParser, new_call_id
from gateway.tools.plan import ToolPlan
from protocol.tools import FunctionCallDelta, ToolCallDelta


def with_tool_calls(reply: Reply, plan: ToolPlan) -> Reply:
    async def pieces(_: Accounting) -> AsyncGenerator[Piece, None]:
        choices: dict[int, _Choice] = {}
        try:
            async for p in reply:
                c = choices.get(p.index)
                if c is None:
                    c = choices[p.index] = _Choice(p.index, plan.parser(), plan.tools.parallel)
                out = c.pieces(p)
                for i, q in enumerate(out):
                    q.more = p.more or i < len(out) - 1
                    yield q
        finally:
            await reply.aclose()

    parsed = Reply(pieces)
    parsed.accounting = reply.accounting
    return parsed


class _Choice:
    """One choice's parser and the calls it emitted so far."""

    def __init__(self, index: int, parser: ToolParser, parallel: bool) -> None:
        self.index = index
        self.parser = parser
        self.parallel = parallel
        self.calls = 0
        #: a call after the first is dropped when parallel_tool_calls is false
        self._dropping = False
        #: tokens of input pieces that produced no output yet (the parser holds their text)
        self._unsent = 0

    def pieces(self, p: Piece) -> list[Piece]:
        events = self.parser.feed(p.text)
        if p.finish_reason:
            events += self.parser.finish()
        text: list[str] = []
        deltas: list[ToolCallDelta] = []
        for e in events:
            self._event(e, text, deltas)
        out = []
        if text or p.logprobs is not None:
            out.append(Piece(index=self.index, text="".join(text), logprobs=p.logprobs))
        if deltas:
            out.append(Piece(index=self.index, text="", tool_calls=deltas))
        if p.finish_reason:
            reason = "tool_calls" if self.calls and p.finish_reason == "stop" else p.finish_reason
            out.append(Piece(index=self.index, text="", finish_reason=reason))
        self._unsent += p.tokens
        if out:  # the first piece out delivers every token held so far
            out[0].tokens, self._unsent = self._unsent, 0
        return out

    def _event(self, e: Event, text: list[str], deltas: list[ToolCallDelta]) -> None:
        if isinstance(e, Text):
            text.append(e.text)
        elif isinstance(e, CallStart):
            self._dropping = self.calls > 0 and not self.parallel
            if self._dropping:
                return
            self.calls += 1
            deltas.append(
                ToolCallDelta(
                    index=self.calls - 1,
                    id=new_call_id(),
                    type="function",
                    function=FunctionCallDelta(name=e.name, arguments=""),
                )
            )
        elif isinstance(e, CallArgs) and not self._dropping:
            deltas.append(
                ToolCallDelta(index=self.calls - 1, function=FunctionCallDelta(arguments=e.text))
            )
