"""A chat conversation with tools as the model's prompt text.

A chat template that renders tools itself (Qwen2.5/3, Llama 3.1+, Hermes: it reads the
`tools` variable) gets them as HF's `apply_chat_template(messages, tools=…)` does: the tool
definitions, assistant turns with `tool_calls` (arguments as objects, as HF templates expect),
and `role: "tool"` turns. Any other template (SmolLM2's) gets duet's generic tool prompt in
the model's tool format (docs/tools.md): the tool definitions in a system turn (appended to
the client's first system message, else a new one at the start), an assistant's calls written
as the format writes them, and a tool result as a user turn wrapped as the format wraps it.

With tool_choice = none the tools are not shown (the conversation's past calls still are).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from gateway.tools.events import past_arguments
from gateway.tools.formats import ToolFormat, template_has_tools
from gateway.tools.plan import ToolMode, ToolPlan
from protocol.tools import ToolCall
from text.tokenizer import Tokenizer


def render(
    tok: Tokenizer,
    messages: Sequence[dict[str, Any]],
    plan: ToolPlan,
    add_generation_prompt: bool = True,
) -> str:
    """The prompt text of `messages` with the plan's tools (the generation prompt added unless
    `add_generation_prompt` is False: a prefix of a conversation)."""
    tools = [msgspec.to_builtins(t) for t in plan.tools.defs] if plan.mode != ToolMode.NONE else []
    gen = add_generation_prompt
    if template_has_tools(tok.chat_template):
        turns = [_hf_turn(m) for m in messages]
        return tok.apply_chat_template(turns, add_generation_prompt=gen, tools=tools or None)
    return tok.apply_chat_template(_generic(messages, tools, plan.fmt), add_generation_prompt=gen)


def _hf_turn(m: dict[str, Any]) -> dict[str, Any]:
    if "tool_calls" not in m:
        return m
    calls = [
        {
            "type": "function",
            "id": c["id"],
            "function": {
                "name": c["function"]["name"],
                "arguments": _args(c["function"]["arguments"]),
            },
        }
        for c in m["tool_calls"]
    ]
    return {**m, "tool_calls": calls}


def _args(text: str) -> Any:
    parsed = past_arguments(text)
    return parsed if parsed is not None else text


def _generic(
    messages: Sequence[dict[str, Any]], tools: list[Any], fmt: ToolFormat
) -> list[dict[str, str]]:
    out: list[dict[str, str]] = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": fmt.result_text(m["content"])})
        elif "tool_calls" in m:
            calls = [msgspec.convert(c, ToolCall) for c in m["tool_calls"]]
            text = fmt.call_text(calls)
            out.append(
                {
                    "role": "assistant",
                    "content": f"{m['content']}\n{text}" if m["content"] else text,
                }
            )
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools:
        prompt = fmt.system_prompt([json.dumps(t, ensure_ascii=False) for t in tools])
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
