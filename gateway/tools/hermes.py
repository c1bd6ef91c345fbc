"""The Hermes tool-call format (Qwen2.5/3, Hermes 2/3, and duet's generic tool prompt):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, possibly after some text. Tool results go back as a user turn holding
`<tool_response>…</tool_response>`.

Streaming: text is passed on as it comes except a tail that may be the start of `<tool_call>`
(held until the next piece decides); inside a block everything is held until `</tool_call>`.
A block whose JSON is not a call of a requested tool, or that the text ends inside without a
whole call, is given back as text, tags included.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from gateway.tools.events import Event, Text, call_events, decode_json, past_arguments
from protocol.tools import ToolCall

NAME = "hermes"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGS_KEY = "arguments"


def _held_prefix(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class HermesParser:
    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _held_prefix(self._buf, OPEN)
                    emit, self._buf = (
                        self._buf[: len(self._buf) - keep],
                        self._buf[len(self._buf) - keep :],
                    )
                    if emit:
                        out.append(Text(emit))
                    return out
                if at:
                    out.append(Text(self._buf[:at]))
                self._buf, self._in_call = self._buf[at:], True
            end = self._buf.find(CLOSE)
            if end < 0:
                return out
            block, self._buf, self._in_call = (
                self._buf[: end + len(CLOSE)],
                self._buf[end + len(CLOSE) :],
                False,
            )
            out += self._block(block)

    def finish(self) -> list[Event]:
        block, self._buf = self._buf, ""
        if not block:
            return []
        return self._block(block) if self._in_call else [Text(block)]

    def _block(self, block: str) -> list[Event]:
        inner = block[len(OPEN) :].removesuffix(CLOSE).strip()
        return call_events(decode_json(inner), self.names, ARGS_KEY) or [Text(block)]


def system_prompt(tool_json: Sequence[str]) -> str:
    """duet's generic tool prompt in this format (Qwen2.5's wording; docs/tools.md)."""
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + "\n".join(tool_json)
        + "\n</tools>\n\nFor each function call, return a json object with function "
        "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def call_text(calls: Sequence[ToolCall]) -> str:
    """An assistant turn's calls, as the model would have written them."""
    return "\n".join(
        f'{OPEN}\n{{"name": {json.dumps(c.function.name)}, "arguments": {_args(c)}}}\n{CLOSE}'
        for c in calls
    )


def result_text(content: str) -> str:
    return f"<tool_response>\n{content}\n</tool_response>"


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """The JSON of one call of `name` (tool_choice = required's guide)."""
    return {
        "type": "object",
        "properties": {"name": {"enum": [name]}, ARGS_KEY: parameters},
        "required": ["name", ARGS_KEY],
        "additionalProperties": False,
    }


def _args(c: ToolCall) -> str:
    parsed = past_arguments(c.function.arguments)
    return (
        json.dumps(parsed, ensure_ascii=False)
        if parsed is not None
        else json.dumps(c.function.arguments)
    )
