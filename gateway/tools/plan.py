"""One request's tool handling on one self-hosted model: the format the model writes, the
mode (`tool_choice`'s effect), and the guide that enforces a forced choice.

- auto: the model chooses; its text is parsed by the format's parser (a call, or text);
- required: the answer is one call of any of the tools, as the format's JSON
  (`{"name", "arguments"|"parameters"}`), enforced by a JSON-schema guide (anyOf the tools);
- a named function: the answer is that function's arguments, enforced by a guide of its
  `parameters` schema; the call's name is the named one;
- none (or no tools): no tools in the prompt, nothing parsed.

The guide goes to both legs (P samples the first token under it); it is checked by the
grammar engine here, before any node work (a 400 naming what is wrong).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from gateway.tools.events import (
    CallArgs,
    CallStart,
    Event,
    Text,
    ToolParser,
    call_events,
    decode_json,
)
from gateway.tools.formats import ToolFormat, tool_format
from gateway.tools.spec import Tools
from protocol.structured import Guide
from text.guide_check import json_schema_guide


class ToolMode(enum.StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    fmt: ToolFormat
    tools: Tools
    guide: Guide | None = None

    def parser(self) -> ToolParser:
        """A parser for one choice's text."""
        if self.mode == ToolMode.NAMED:
            assert self.tools.named is not None
            return _Named(self.tools.named)
        if self.mode == ToolMode.REQUIRED:
            return _Required(self.tools.names, self.fmt.args_key)
        return self.fmt.parser(self.tools.names)


def schema_guide(schema: dict[str, Any], closed: bool = True) -> Guide:
    """A JSON-schema guide in the contract's canonical form (compact, keys in the client's
    order), its objects closed where the schema leaves them open (text/json_closed.py): a tool's
    parameters that omit `additionalProperties` name every argument the call takes. `closed`
    false (the model's `closed_objects = false`): as written."""
    return json_schema_guide(schema, closed=closed)


def plan_for(
    tools: Tools, configured: str | None, template: str | None, closed: bool = True
) -> ToolPlan:
    """The plan of a request's `tools` on a model (its configured tool_parser, its template,
    its `closed_objects`)."""
    fmt = tool_format(configured, template)
    mode = ToolMode(tools.choice)
    guide = None
    if mode == ToolMode.NAMED:
        assert tools.named is not None
        guide = schema_guide(tools.parameters(tools.named), closed)
    elif mode == ToolMode.REQUIRED:
        calls = [fmt.call_schema(n, tools.parameters(n)) for n in tools.names]
        guide = schema_guide(calls[0] if len(calls) == 1 else {"anyOf": calls}, closed)
    return ToolPlan(mode, fmt, tools, guide)


class _Named:
    """tool_choice names a function: the text is its arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not self._started:
            self._started = True
            out.append(CallStart(self.name))
        if text:
            out.append(CallArgs(text))
        return out

    def finish(self) -> list[Event]:
        return []  # an empty answer (the guide makes none) is no call


class _Required:
    """tool_choice = required: the text is one call's JSON, parsed when it ends (text when it
    does not parse: max_tokens cut it)."""

    def __init__(self, names: tuple[str, ...], args_key: str) -> None:
        self.names, self.args_key = names, args_key
        self._buf = ""

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return []

    def finish(self) -> list[Event]:
        raw, self._buf = self._buf, ""
        return call_events(decode_json(raw), self.names, self.args_key) or (
            [Text(raw)] if raw else []
        )
