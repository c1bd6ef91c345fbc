"""`POST /v1/responses` (OpenAI's Responses API, stateless) through a real `duet gateway`
process, with the official `openai` client's `client.responses.create`.

Served by translation onto the chat path, so it reaches every model: the tiny Llama on a real
node (plain text) and external models behind the fake OpenAI and Anthropic providers
(tests/providers/fakes.py), which answer a tool request with a deterministic call. The module
starts the /v1/messages module's cluster (one node, one gateway, two fakes).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.helpers import http
from tests.gateway.test_anthropic_api import Env, cluster
from tests.gateway.test_providers_e2e import record

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    },
}


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from cluster(tiny_llama, tmp_path_factory)


def client(env: Env) -> openai.OpenAI:
    return openai.OpenAI(base_url=env.gw.url + "/v1", api_key=env.key, max_retries=0, timeout=60)


@pytest.mark.parametrize("model", ["gpt", "claude", "tiny"])
def test_text_whole_and_streamed(env: Env, model: str) -> None:
    c = client(env)
    kw: dict[str, Any] = {
        "model": model,
        "input": "hello there",
        "instructions": "Be brief.",
        "max_output_tokens": 8,
    }
    raw = c.responses.with_raw_response.create(**kw)
    r = raw.parse()
    assert r.object == "response" and r.model == model and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete") and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 8
    if model != "tiny":
        assert r.output_text == "echo: hello there" and r.status == "completed"
    else:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    rec = record(env, raw.headers["x-request-id"])
    assert rec["model_used"] == model and rec["cost_usd"] > 0

    events = list(c.responses.create(**kw, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == ("response.completed" if model != "tiny" else "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text == events[-1].response.output_text
    if model != "tiny":
        assert text == r.output_text
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens or model == "tiny"


@pytest.mark.parametrize("model", ["gpt", "claude"])
def test_function_call_whole_streamed_and_continued(env: Env, model: str) -> None:
    c = client(env)
    kw: dict[str, Any] = {
        "model": model,
        "input": [{"role": "user", "content": "weather in Paris"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_output_tokens": 64,
    }
    raw = c.responses.with_raw_response.create(**kw)
    r = raw.parse()
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"query": "weather in Paris"}
    assert r.output[0].type == "message" and r.output_text == "Let me check."
    assert record(env, raw.headers["x-request-id"])["cost_usd"] > 0

    with c.responses.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert (
        "response.function_call_arguments.delta" in types
        and "response.function_call_arguments.done" in types
    )
    assert types[-1] == "response.completed"
    fc = next(o for o in final.output if o.type == "function_call")
    assert fc.arguments == calls[0].arguments and fc.call_id

    follow = c.responses.create(
        model=model,
        tools=[WEATHER],
        max_output_tokens=64,
        input=[
            *kw["input"],
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"},
        ],
    )
    assert follow.status == "completed" and follow.output_text.startswith("echo: ")
    sent = env.fakes[model].requests[-1]
    if model == "gpt":
        assert sent["messages"][-1] == {
            "role": "tool",
            "tool_call_id": calls[0].call_id,
            "content": "sunny, 21 C",
        }
    else:
        assert sent["messages"][-1]["content"][0]["type"] == "tool_result"


def test_previous_response_id_is_refused_clearly(env: Env) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(env).responses.create(model="gpt", input="hi", previous_response_id="resp_123")
    assert (
        "stores no responses" in e.value.message and e.value.body["param"] == "previous_response_id"
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "gpt"}, "input"),
        ({"model": "gpt", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "gpt", "input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"model": "gpt", "input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ],
)
def test_bad_bodies_are_openai_400s(env: Env, body: dict[str, Any], param: str) -> None:
    status, _, got = http(env.gw.url + "/v1/responses", "POST", body=body, key=env.key)
    assert status == 400 and got["error"]["param"] == param, got


def test_bad_key_is_401(env: Env) -> None:
    status, _, got = http(
        env.gw.url + "/v1/responses", "POST", body={"model": "gpt", "input": "hi"}, key="sk-duet-no"
    )
    assert status == 401 and got["error"]["type"] == "authentication_error"
