"""`/v1/messages` and `/v1/responses` on the real default model: SmolLM2 on a real node, the
official `anthropic` and `openai` clients. Both APIs are translations onto the chat path, so
greedy answers equal the chat endpoint's, whole and streamed, and a forced tool choice gives a
call whose input validates against the tool's schema (the chat path's guide, gateway/tools/)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team, tiny_model
from tests.procs import duet_node, running

pytestmark = pytest.mark.smollm2
COMMON = ("--kv-blocks", "256", "--max-model-len", "2048")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
          "additionalProperties": False}  # fmt: skip


@dataclass
class Clients:
    oai: openai.OpenAI
    claude: anthropic.Anthropic


@pytest.fixture(scope="module")
def clients(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    tmp = tmp_path_factory.mktemp("translated-smollm2")
    node = duet_node("both", smollm2, tmp, *COMMON, threads=None)
    gw = gateway_proc(tmp, {"smollm2": tiny_model(smollm2, both=[node.url])})
    with running(node, gw):
        key = make_team(gw.url, "smol")
        yield Clients(openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120),
                      anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=120))  # fmt: skip


def test_text_equals_the_chat_endpoints(clients: Clients) -> None:
    oai, claude = clients.oai, clients.claude
    system, question = "You are a concise assistant.", "What is the capital of France?"
    chat = oai.chat.completions.create(model="smollm2", max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])  # fmt: skip
    expected = chat.choices[0].message.content
    assert "Paris" in expected

    # this SDK has no temperature argument any more (the API's older field): sent as extra_body
    kw = {"model": "smollm2", "max_tokens": 24, "extra_body": {"temperature": 0}, "system": system,
          "messages": [{"role": "user", "content": question}]}  # fmt: skip
    msg = claude.messages.create(**kw)
    assert msg.content[0].text == expected
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn")
    with claude.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == expected

    r = oai.responses.create(model="smollm2", instructions=system, input=question, max_output_tokens=24, temperature=0)
    assert r.output_text == expected and r.usage.output_tokens == chat.usage.completion_tokens
    streamed = "".join(e.delta for e in oai.responses.create(model="smollm2", instructions=system, input=question,
                                                             max_output_tokens=24, temperature=0, stream=True)
                       if e.type == "response.output_text.delta")  # fmt: skip
    assert streamed == expected


def test_forced_tool_choice_gives_a_schema_valid_call(clients: Clients) -> None:
    ask = "What is the weather in Paris?"
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
    msg = clients.claude.messages.create(model="smollm2", max_tokens=48, tools=[tool], messages=[
        {"role": "user", "content": ask}], tool_choice={"type": "tool", "name": "get_weather"})  # fmt: skip
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "get_weather", msg
    jsonschema.validate(calls[0].input, SCHEMA)
    fn = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": SCHEMA}
    r = clients.oai.responses.create(model="smollm2", input=ask, tools=[fn], max_output_tokens=48,
                                     tool_choice={"type": "function", "name": "get_weather"})  # fmt: skip
    fc = [o for o in r.output if o.type == "function_call"]
    assert len(fc) == 1 and fc[0].name == "get_weather", r
    jsonschema.validate(json.loads(fc[0].arguments), SCHEMA)
