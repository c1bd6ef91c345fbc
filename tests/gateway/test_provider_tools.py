"""External models pass the tool, structured-output and sampling request fields through, with
the official `openai` client on `/v1/chat/completions`: tools, tool_choice, tool turns,
response_format, penalties and logit_bias reach an OpenAI-compatible provider unchanged; an
Anthropic provider gets tools and tool results translated both ways and refuses what it cannot do
with a 400 naming it; fallback chains and `model: "auto"` only pick a model that serves the
request's features.

Fakes only for the commercial APIs (tests/providers/fakes.py); the gateway is a real process.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.helpers import make_team
from tests.gateway.test_anthropic_api import Env, cluster
from tests.gateway.test_providers_e2e import record
from tests.providers.fakes import Fault

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
ASK = [{"role": "user", "content": "weather in Paris"}]


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from cluster(tiny_llama, tmp_path_factory, node=False)


def client(env: Env, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=env.gw.url + "/v1", api_key=key or env.key, max_retries=0, timeout=60
    )


@pytest.mark.parametrize("model", ["gpt", "claude"])
def test_the_same_tool_request_works_and_is_billed(env: Env, model: str) -> None:
    c = client(env)
    raw = c.chat.completions.with_raw_response.create(
        model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=64
    )
    r = raw.parse()
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
        "query": "weather in Paris"
    }
    rec = record(env, raw.headers["x-request-id"])
    assert rec["model_used"] == model and rec["completion_tokens"] == 7 and rec["cost_usd"] > 0
    assert float(raw.headers["x-duet-cost-usd"]) == pytest.approx(rec["cost_usd"])

    stream = c.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [t for ch in chunks if ch.choices for t in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"
    assert chunks[-1].usage.completion_tokens == 7

    turns = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    after = c.chat.completions.create(model=model, messages=turns, tools=[WEATHER], max_tokens=64)
    assert after.choices[0].finish_reason == "stop" and after.choices[0].message.content.startswith(
        "echo: "
    )


def test_openai_compatible_provider_gets_the_fields_unchanged(env: Env) -> None:
    fields = {
        "frequency_penalty": 0.5,
        "presence_penalty": -0.25,
        "logit_bias": {"42": -100},
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "w",
                "schema": {
                    "type": "object",
                    "properties": {"t": {"type": "integer"}},
                    "required": ["t"],
                },
                "strict": True,
            },
        },
        "parallel_tool_calls": False,
        "tool_choice": "auto",
    }
    r = client(env).chat.completions.create(
        model="gpt", messages=ASK, tools=[WEATHER], max_tokens=16, **fields
    )
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    sent = env.fakes["gpt"].requests[-1]
    assert {k: sent[k] for k in fields} == fields
    assert sent["tools"] == [WEATHER]


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"logit_bias": {"42": -100}}, "logit_bias"),
        ({"frequency_penalty": 0.5}, "penalties"),
    ],
)
def test_anthropic_refuses_what_it_cannot_do_by_name(
    env: Env, extra: dict[str, Any], names: str
) -> None:
    before = len(env.fakes["claude"].requests)
    with pytest.raises(openai.BadRequestError) as e:
        client(env).chat.completions.create(model="claude", messages=ASK, max_tokens=8, **extra)
    assert names in e.value.message and e.value.code == "unsupported_feature"
    assert len(env.fakes["claude"].requests) == before  # refused before any provider call


def test_fallback_skips_a_model_without_the_requests_features(env: Env) -> None:
    """gpt fails (500): its chain is claude, then gpt2. A request with penalties skips claude,
    which has none; a tool request may go to claude."""
    c = client(env)
    env.fakes["gpt"].faults.append(Fault.http(500))
    raw = c.chat.completions.with_raw_response.create(
        model="gpt", messages=ASK, max_tokens=8, frequency_penalty=0.5
    )
    assert raw.headers["x-duet-model-used"] == "gpt2"
    assert env.fakes["gpt2"].requests[-1]["frequency_penalty"] == 0.5
    env.fakes["gpt"].faults.append(Fault.http(500))
    raw = c.chat.completions.with_raw_response.create(
        model="gpt", messages=ASK, max_tokens=64, tools=[WEATHER]
    )
    assert raw.headers["x-duet-model-used"] == "claude"
    assert raw.parse().choices[0].message.tool_calls[0].function.name == "get_weather"


def test_auto_only_picks_a_model_with_the_requests_features(env: Env) -> None:
    c = client(env, make_team(env.gw.url, "pinned"))
    hi = [{"role": "user", "content": "hi"}]
    raw = c.chat.completions.with_raw_response.create(model="auto", messages=hi, max_tokens=8)
    assert raw.headers["x-duet-model-used"] == "claude"  # the team's pin
    raw = c.chat.completions.with_raw_response.create(
        model="auto", messages=hi, max_tokens=8, logit_bias={"7": 5}
    )
    assert raw.headers["x-duet-model-used"] == "gpt"
