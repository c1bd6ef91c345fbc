"""OpenAI's tool-calling shapes, as the public API speaks them.

Requests: `tools` (function definitions), `tool_choice` (none | auto | required | a named
function), and, in the conversation, an assistant turn's `tool_calls` and the `role: "tool"`
results. Answers: `message.tool_calls` (whole) and `delta.tool_calls` (streamed: the first
delta of a call carries its id, type and name; later ones append `function.arguments`).

A function's `parameters` is a JSON Schema, open-ended by nature: it is checked by the grammar
engine and `jsonschema`, not by a Struct.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class FunctionDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One entry of `tools`: `{"type": "function", "function": {...}}`."""

    type: str
    function: FunctionDef


class NamedFunction(msgspec.Struct, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """`tool_choice: {"type": "function", "function": {"name": ...}}`: call this function."""

    type: str
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    #: the arguments as a JSON text (OpenAI's: a string, not an object)
    arguments: str


class ToolCall(msgspec.Struct, kw_only=True):
    """A call in an assistant message (`message.tool_calls`, and in the conversation sent back)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of call `index` of a choice (`delta.tool_calls[i]`)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None
