"""Llama 3.1/3.2/3.3's JSON tool-call format (the "JSON based tool calling" of Meta's prompt
guide, vLLM's `llama3_json`): the whole answer is a call,

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after the `<|python_tag|>` token, several calls separated by `;`. Tool results go
back as an `ipython` turn in Llama's template; in duet's generic prompt as a user turn.

Streaming: an answer whose first non-blank character is `{` is held to its end and parsed
there (a call only when every part is a call of a requested tool, else the text as it was);
any other answer is text from its first piece on.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from gateway.tools.events import Event, Text, call_events, decode_json, past_arguments
from protocol.tools import ToolCall

NAME = "llama3_json"
PYTHON_TAG = "<|python_tag|>"
ARGS_KEY = "parameters"


class Llama3JsonParser:
    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self._buf = ""
        #: None: undecided (only blanks so far); True: holding a call; False: plain text
        self._call: bool | None = None

    def feed(self, text: str) -> list[Event]:
        if self._call is False:
            return [Text(text)] if text else []
        self._buf += text
        head = self._buf.lstrip().removeprefix(PYTHON_TAG).lstrip()
        if not head or (PYTHON_TAG.startswith(self._buf.lstrip()) and self._call is None):
            return []
        self._call = head.startswith("{")
        if self._call:
            return []
        out, self._buf = self._buf, ""
        return [Text(out)]

    def finish(self) -> list[Event]:
        raw, self._buf = self._buf, ""
        if not raw:
            return []
        body = raw.strip().removeprefix(PYTHON_TAG).strip()
        events: list[Event] = []
        for part in _parts(body):
            ev = call_events(decode_json(part), self.names, ARGS_KEY)
            if ev is None:
                return [Text(raw)]
            events += ev
        return events or [Text(raw)]


def _parts(body: str) -> list[str]:
    """`{…}; {…}` as its calls (one JSON text when it parses whole)."""
    if decode_json(body) is not None:
        return [body]
    return [p for p in (s.strip() for s in body.split(";")) if p]


def system_prompt(tool_json: Sequence[str]) -> str:
    """duet's generic tool prompt in this format (Meta's JSON tool-calling wording)."""
    return (
        "Given the following functions, please respond with a JSON for a function call with its "
        "proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name '
        "and its value}. Do not use variables. If no function fits, answer in plain text.\n\n"
        + "\n\n".join(tool_json)
    )


def call_text(calls: Sequence[ToolCall]) -> str:
    return "; ".join(
        f'{{"name": {json.dumps(c.function.name)}, "parameters": {_args(c)}}}' for c in calls
    )


def result_text(content: str) -> str:
    return f"Tool result:\n{content}"


def call_schema(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
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
