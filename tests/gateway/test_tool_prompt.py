"""Tool prompts (gateway/tools/prompt.py): a chat template that renders tools gets them exactly
as HF transformers' `apply_chat_template(messages, tools=…)` renders them (the oracle), past
calls and tool results included; SmolLM2's template, which has no tools, gets duet's generic
Hermes prompt (docs/tools.md) in a system turn, past calls as `<tool_call>` blocks and results
as `<tool_response>` user turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.requests import parse_chat
from gateway.tools.plan import plan_for
from gateway.tools.prompt import render
from protocol.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2

# A template in the style of Qwen2.5's: the tools in the system turn, calls as <tool_call>
# blocks, tool results as <tool_response> inside a user turn.
QWEN_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}  # fmt: skip
BODY = {"model": "m", "tools": [WEATHER], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, clear"},
    {"role": "user", "content": "And tomorrow?"}]}  # fmt: skip


def test_a_template_with_tools_renders_as_transformers_does(smollm2: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    ours = Tokenizer(smollm2)
    ours.chat_template = QWEN_STYLE
    req = parse_chat(json.dumps(BODY).encode())
    assert req.messages is not None
    text = render(ours, req.messages, plan_for(req.tools, None, QWEN_STYLE))
    hf_messages = json.loads(json.dumps(BODY["messages"]))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # HF templates take objects
    want = hf.apply_chat_template(hf_messages, tools=[WEATHER], chat_template=QWEN_STYLE, tokenize=False,
                                  add_generation_prompt=True)  # fmt: skip
    assert text == want
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert json.dumps(WEATHER) in text  # the tool as the client sent it (no nulls added)


def test_smollm2_gets_the_generic_hermes_prompt(smollm2: Path) -> None:
    tok = Tokenizer(smollm2)
    req = parse_chat(json.dumps(BODY).encode())
    assert req.messages is not None
    text = render(tok, req.messages, plan_for(req.tools, None, tok.chat_template))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n") and json.dumps(WEATHER) in system
    assert "<tool_call>" in system  # how to call
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>") in text  # fmt: skip
    assert "<|im_start|>user\n<tool_response>\n21 C, clear\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    # tool_choice none: no tools in the prompt, the past call still rendered
    none = parse_chat(json.dumps({**BODY, "tool_choice": "none"}).encode())
    assert none.messages is not None
    plain = render(tok, none.messages, plan_for(none.tools, None, tok.chat_template))
    assert "# Tools" not in plain and "<tool_response>" in plain
