"""Checking a chat request's tools, tool_choice and tool turns (OpenAI's rules and words).

- `tools`: at most 128, each `{"type": "function", "function": {"name", "description",
  "parameters"}}`; names `^[a-zA-Z0-9_-]{1,64}$`, unique; `parameters` a JSON Schema object
  (absent: no arguments).
- `tool_choice`: none | auto | required | `{"type": "function", "function": {"name"}}` naming
  one of the tools; tool_choice and parallel_tool_calls only with tools.
- an assistant turn may carry `tool_calls` (its content may then be null); a `role: "tool"`
  turn needs `tool_call_id` and content.

Every refusal is a 400 naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.chat import ChatMessage
from protocol.openai import APIError
from protocol.tools import NamedToolChoice, ToolChoice, ToolDef

MAX_TOOLS = 128
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
#: `parameters` when a function takes none
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tools:
    """A request's checked tools: the definitions, the choice (its effective value: "none"
    without tools) and whether several calls may come in one turn."""

    defs: tuple[ToolDef, ...] = ()
    choice: str = "none"  # none | auto | required | named
    #: the function tool_choice names (choice == "named")
    named: str | None = None
    parallel: bool = True

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.function.name for t in self.defs)

    def parameters(self, name: str) -> dict[str, Any]:
        for t in self.defs:
            if t.function.name == name:
                return t.function.parameters or NO_PARAMETERS
        raise KeyError(name)


def check_tools(
    tools: list[ToolDef] | None, choice: ToolChoice | None, parallel: bool | None
) -> Tools:
    if not tools:
        if choice not in (None, "none"):
            raise APIError(
                400, "tool_choice is only allowed when tools are specified", param="tool_choice"
            )
        if parallel is not None:
            raise APIError(
                400,
                "parallel_tool_calls is only allowed when tools are specified",
                param="parallel_tool_calls",
            )
        return Tools()
    if len(tools) > MAX_TOOLS:
        raise APIError(
            400, f"tools takes at most {MAX_TOOLS} functions, got {len(tools)}", param="tools"
        )
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.type != "function":
            raise APIError(
                400, f"tools[{i}].type must be 'function', got {t.type!r}", param=f"tools[{i}].type"
            )
        name = t.function.name
        if not _NAME.match(name):
            raise APIError(
                400,
                f"tools[{i}].function.name must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name!r}",
                param=f"tools[{i}].function.name",
            )
        if name in seen:
            raise APIError(
                400, f"tools[{i}]: the function name {name!r} is given twice", param=f"tools[{i}]"
            )
        seen.add(name)
        p = t.function.parameters
        if p is not None and p.get("type", "object") != "object":
            raise APIError(
                400,
                f"tools[{i}].function.parameters must be a JSON Schema of type 'object'",
                param=f"tools[{i}].function.parameters",
            )
    named = None
    if isinstance(choice, NamedToolChoice):
        if choice.type != "function" or choice.function.name not in seen:
            raise APIError(
                400,
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(sorted(seen))})",
                param="tool_choice",
            )
        named = choice.function.name
    mode = "named" if named else (choice or "auto")
    return Tools(tuple(tools), str(mode), named, parallel is not False)


def tool_turn(i: int, m: ChatMessage, content: str | None) -> dict[str, Any]:
    """A message with its tool fields, checked, in OpenAI's form (content a string)."""
    if m.role == "tool":
        if not m.tool_call_id:
            raise APIError(
                400,
                f"messages[{i}]: a 'tool' message needs tool_call_id",
                param=f"messages[{i}].tool_call_id",
            )
        if content is None:
            raise APIError(
                400, f"messages[{i}]: content is required", param=f"messages[{i}].content"
            )
        return {"role": "tool", "tool_call_id": m.tool_call_id, "content": content}
    if m.tool_call_id is not None:
        raise APIError(
            400,
            f"messages[{i}]: tool_call_id belongs on a 'tool' message",
            param=f"messages[{i}].tool_call_id",
        )
    if m.role != "assistant":
        raise APIError(
            400,
            f"messages[{i}]: tool_calls belong on an 'assistant' message",
            param=f"messages[{i}].tool_calls",
        )
    for j, c in enumerate(m.tool_calls or ()):
        if c.type != "function":
            raise APIError(
                400,
                f"messages[{i}].tool_calls[{j}].type must be 'function'",
                param=f"messages[{i}].tool_calls",
            )
    return {
        "role": "assistant",
        "content": content or "",
        "tool_calls": msgspec.to_builtins(m.tool_calls),
    }
