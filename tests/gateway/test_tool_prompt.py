"""Tool prompts (gateway/tools/prompt.py): a chat template that renders tools gets them exactly
as HF transformers' `apply_chat_template(messages, tools=…)` renders them (the oracle), past
calls and tool results included; SmolLM2's template, which has no tools, gets duet's generic
Hermes prompt (docs/tools.md) in a system turn, past calls as `<tool_call>` blocks and results
as `<tool_response>` user turns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.serving.chat import parse_chat
from gateway.tools.formats import template_has_tools
from gateway.tools.plan import plan_for
from gateway.tools.prompt import render
from text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2

# A template in the style of Qwen2.5's: the tools in the system turn, calls as <tool_call>
# blocks, tool results as <tool_response> inside a user turn.
QWEN_STYLE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}
{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- "\\n\\n# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
{%- if messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first)
    or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == "tool" %}
{{- '<|im_start|>user\\n<tool_response>\\n' }}{{- message.content }}
{{- '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

# A template in the style of Llama 3.1's JSON tool calling (written for this test): the tool
# definitions, indented, in the first user turn with the `{"name", "parameters"}` instruction;
# a past call as `<|python_tag|>` JSON; a tool result as an `ipython` turn.
LLAMA_STYLE = """{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
{%- set system_message = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{%- else %}{%- set system_message = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n\\n' }}{%- endif %}
{{- system_message + '<|eot_id|>' }}
{%- if tools is not none %}
{%- set first_user = messages[0]['content'] | trim %}{%- set messages = messages[1:] %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
{{- 'To call a function, answer {"name": function name, ' }}
{{- '"parameters": its arguments as an object}.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{{- first_user + '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' or message.role == 'ipython' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
{{- {'output': message.content} | tojson }}{{- '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>{"name": "' + call.name
    + '", "parameters": ' }}
{{- call.arguments | tojson }}{{- '}<|eom_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' }}
{{- message.content | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BODY = {
    "model": "m",
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C, clear"},
        {"role": "user", "content": "And tomorrow?"},
    ],
}


def test_a_template_with_tools_renders_as_transformers_does(smollm2: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    ours = Tokenizer(smollm2)
    ours.chat_template = QWEN_STYLE
    req = parse_chat(json.dumps(BODY).encode())
    assert req.messages is not None
    text = render(ours, req.messages, plan_for(req.tools, None, QWEN_STYLE))
    hf_messages = json.loads(json.dumps(BODY["messages"]))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {
        "city": "Paris"
    }  # HF templates take objects
    want = hf.apply_chat_template(
        hf_messages,
        tools=[WEATHER],
        chat_template=QWEN_STYLE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == want
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert json.dumps(WEATHER) in text  # the tool as the client sent it (no nulls added)


def test_a_llama_style_template_renders_as_transformers_does_and_picks_llama_json(
    smollm2: Path,
) -> None:
    """Llama 3.1's way: the template renders the tools (HF's oracle), the format is detected as
    Llama 3.1 JSON, and that format's parser and forced-choice guide are the plan's."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    ours = Tokenizer(smollm2)
    ours.chat_template = LLAMA_STYLE
    req = parse_chat(json.dumps(BODY).encode())
    assert req.messages is not None
    plan = plan_for(req.tools, None, LLAMA_STYLE)
    assert plan.fmt.name == "llama3_json"
    text = render(ours, req.messages, plan)
    hf_messages = json.loads(json.dumps(BODY["messages"]))
    hf_messages[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    want = hf.apply_chat_template(
        hf_messages,
        tools=[WEATHER],
        chat_template=LLAMA_STYLE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == want
    assert json.dumps(WEATHER, indent=4) in text and "Weather in Paris?<|eot_id|>" in text
    assert (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>' in text
    )
    assert (
        '<|start_header_id|>ipython<|end_header_id|>\n\n{"output": "21 C, clear"}<|eot_id|>' in text
    )
    # what such a model answers is parsed as Llama 3.1 JSON, whole or streamed
    parser = plan.parser()
    events = parser.feed('<|python_tag|>{"name": "get_weather", ') + parser.feed(
        '"parameters": {"city": "Rome"}}'
    )
    events += parser.finish()
    assert [type(e).__name__ for e in events][:1] == ["CallStart"] and events[
        0
    ].name == "get_weather"  # type: ignore[union-attr]
    assert json.loads("".join(e.text for e in events[1:])) == {"city": "Rome"}  # type: ignore[union-attr]
    # required: the guide makes the model write Llama's {"name", "parameters"}
    required = parse_chat(json.dumps({**BODY, "tool_choice": "required"}).encode())
    guide = plan_for(required.tools, None, LLAMA_STYLE).guide
    assert guide is not None and "parameters" in json.loads(guide.spec)["required"]
    # tool_choice none: the template is called without tools (its plain system turn)
    none = parse_chat(json.dumps({**BODY, "tool_choice": "none"}).encode())
    assert none.messages is not None
    plain = render(ours, none.messages, plan_for(none.tools, None, LLAMA_STYLE))
    assert "Environment: ipython" not in plain and json.dumps(WEATHER, indent=4) not in plain
    assert plain == hf.apply_chat_template(
        hf_messages, chat_template=LLAMA_STYLE, tokenize=False, add_generation_prompt=True
    )


def test_smollm2_gets_the_generic_hermes_prompt(smollm2: Path) -> None:
    tok = Tokenizer(smollm2)
    req = parse_chat(json.dumps(BODY).encode())
    assert req.messages is not None
    text = render(tok, req.messages, plan_for(req.tools, None, tok.chat_template))
    system = text.split("<|im_end|>")[0]
    assert (
        system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
        and json.dumps(WEATHER) in system
    )
    assert "<tool_call>" in system  # how to call
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}\n'
        "</tool_call><|im_end|>"
    ) in text
    assert "<|im_start|>user\n<tool_response>\n21 C, clear\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    # tool_choice none: no tools in the prompt, the past call still rendered
    none = parse_chat(json.dumps({**BODY, "tool_choice": "none"}).encode())
    assert none.messages is not None
    plain = render(tok, none.messages, plan_for(none.tools, None, tok.chat_template))
    assert "# Tools" not in plain and "<tool_response>" in plain


def test_a_template_that_only_mentions_tools_gets_the_generic_prompt(smollm2: Path) -> None:
    """Only a template that reads the `tools` variable renders them; one whose text merely says
    "tools" (a comment, a default system prompt) would drop them, so it gets the generic prompt."""
    tok = Tokenizer(smollm2)
    assert tok.chat_template is not None and not template_has_tools(tok.chat_template)
    tok.chat_template = "{#- this template has no tools support #}\n" + tok.chat_template
    req = parse_chat(json.dumps(BODY).encode())
    assert req.messages is not None
    text = render(tok, req.messages, plan_for(req.tools, None, tok.chat_template))
    assert "# Tools" in text and json.dumps(WEATHER) in text  # the tools reach the model
    assert template_has_tools(QWEN_STYLE) and template_has_tools(LLAMA_STYLE)
    assert template_has_tools(
        "{% if custom_tools is defined %}{% set tools = custom_tools %}{% endif %}{{ tools }}"
    )
