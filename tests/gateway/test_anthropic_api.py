"""`POST /v1/messages` through a real `duet gateway` process, with the official `anthropic` client.

The gateway serves Anthropic's Messages API by translation onto its chat path, so every model
answers it: a self-hosted one (the tiny Llama on a real node) and external ones behind the fake
OpenAI and Anthropic providers (tests/providers/fakes.py), which answer a tool request with a
deterministic call. Checked where a client and an operator look: the SDK's parsed objects
(streamed and not), the usage record and its cost, and Anthropic's error shape.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.gateway.conftest import COMMON
from tests.gateway.helpers import gateway_proc, http, make_team, tiny_model
from tests.gateway.test_providers_e2e import CLAUDE, GPT, FakeServers, external, record
from tests.procs import Proc, duet_node, running
from tests.providers.fakes import API_KEY, FakeProvider, Fault

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    },
}


@dataclass
class Env:
    gw: Proc
    fakes: dict[str, FakeProvider]
    db: Path
    key: str

    def client(self, key: str | None = None) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.gw.url, api_key=key or self.key, max_retries=0, timeout=60
        )


def cluster(
    tiny_llama: Path,
    tmp_path_factory: pytest.TempPathFactory,
    node: bool = True,
    thinking: bool = False,
) -> Iterator[Env]:
    """A gateway with external models on three fake providers (`gpt` falls back to `claude`,
    then `gpt2`; `auto` picks between `claude` and `gpt`, team `pinned` pins simple prompts to
    `claude`) and, with `node`, the tiny Llama on a real node; with `thinking`, `claude-thinks`
    on the same fake, its features listing `thinking`. Also test_responses_api.py's and
    test_provider_tools.py's."""
    tmp = tmp_path_factory.mktemp("translated-api")
    servers = FakeServers({"gpt": "openai", "gpt2": "openai", "claude": "anthropic"})
    f = servers.fakes
    try:
        proc = duet_node("both", tiny_llama, tmp, *COMMON) if node else None
        with running(*([proc] if proc else [])), pytest.MonkeyPatch.context() as mp:
            mp.setenv("FAKE_PROVIDER_KEY", API_KEY)
            models = {
                "gpt": external(f["gpt"], GPT, 2, fallback=["claude", "gpt2"]),
                "gpt2": external(f["gpt2"], GPT, 2),
                "claude": external(f["claude"], CLAUDE, 3),
            }
            if proc is not None:
                models["tiny"] = tiny_model(tiny_llama, both=[proc.url])
            if thinking:
                models["claude-thinks"] = external(
                    f["claude"], CLAUDE, 3, features=["tools", "thinking"]
                )
            gw = gateway_proc(
                tmp,
                models,
                auto={"models": ["claude", "gpt"]},
                **{"teams.pinned": {"auto_pin": {"simple": "claude"}}},
            )
            with running(gw):
                yield Env(gw, f, tmp / "gateway.db", make_team(gw.url, "main"))
    finally:
        servers.close()


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from cluster(tiny_llama, tmp_path_factory)


@pytest.mark.parametrize("model", ["gpt", "claude", "tiny"])
def test_text_whole_and_streamed(env: Env, model: str) -> None:
    c = env.client()
    kw: dict[str, Any] = {
        "model": model,
        "max_tokens": 8,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hello there"}],
    }
    raw = c.messages.with_raw_response.create(**kw)
    msg = raw.parse()
    assert msg.type == "message" and msg.role == "assistant" and msg.model == model
    assert msg.content[0].type == "text" and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens > 0 and 0 < msg.usage.output_tokens <= 8
    if model != "tiny":  # the fakes echo deterministically
        assert msg.content[0].text == "echo: hello there" and msg.stop_reason == "end_turn"
    rec = record(env, raw.headers["x-request-id"])
    assert rec["model_used"] == model and rec["status"] == "ok" and rec["cost_usd"] > 0

    with c.messages.stream(**kw) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_message()
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert (
        "content_block_start" in types
        and "content_block_stop" in types
        and "message_delta" in types
    )
    assert final.content[0].text == msg.content[0].text or model == "tiny"
    assert final.usage.output_tokens == msg.usage.output_tokens or model == "tiny"
    # the second call of the same prompt may read the self-hosted prefix cache: the sum is equal
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == msg.usage.input_tokens


def test_bad_key_is_an_anthropic_401(env: Env) -> None:
    with pytest.raises(anthropic.AuthenticationError) as e:
        env.client("sk-duet-nope").messages.create(
            model="gpt", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.status_code == 401
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": e.value.body["error"]["message"]},
    }


def test_bearer_key_works_too(env: Env) -> None:
    status, _, body = http(
        env.gw.url + "/v1/messages",
        "POST",
        key=env.key,
        body={"model": "gpt", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert status == 200, body
    assert body["type"] == "message" and body["content"][0]["text"] == "echo: hi"


@pytest.mark.parametrize(
    "body, says",
    [
        ({"model": "gpt", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        (
            {"model": "gpt", "max_tokens": 4, "messages": [{"role": "robot", "content": "hi"}]},
            "role",
        ),
        (
            {
                "model": "gpt",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "temperature": 1.5,
            },
            "temperature",
        ),
        (
            {
                "model": "gpt",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled"},
            },
            "thinking",
        ),
        (
            {"model": "nope", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            "nope",
        ),
    ],
)
def test_bad_bodies_are_anthropic_errors(env: Env, body: dict[str, Any], says: str) -> None:
    status, headers, got = http(
        env.gw.url + "/v1/messages", "POST", body=body, key=None, headers={"x-api-key": env.key}
    )
    assert status == (404 if says == "nope" else 400), got
    assert got["type"] == "error" and says in got["error"]["message"]
    assert got["error"]["type"] == (
        "not_found_error" if says == "nope" else "invalid_request_error"
    )
    assert headers.get("request-id", "").startswith("req-")


def test_malformed_json_is_an_anthropic_400(env: Env) -> None:
    status, _, got = http(env.gw.url + "/v1/messages", "POST", raw=b"{not json", key=env.key)
    assert (
        status == 400 and got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
    )
    assert got["error"]["message"].startswith("malformed JSON body")


def _tool_turns(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 64,
        "tools": [WEATHER],
        "tool_choice": {"type": "any"},
        "messages": [{"role": "user", "content": "weather in Paris"}],
    }


@pytest.mark.parametrize("model", ["gpt", "claude"])
def test_tools_whole_streamed_and_continued(env: Env, model: str) -> None:
    """The same tool request on an OpenAI and an Anthropic provider: a tool_use block whose input
    is the call's arguments, streamed as input_json_delta, billed; its result continues."""
    c, fake = env.client(), env.fakes[model]
    kw = _tool_turns(model)
    raw = c.messages.with_raw_response.create(**kw)
    msg = raw.parse()
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    call = msg.content[1]
    assert call.name == "get_weather" and call.input == {"query": "weather in Paris"} and call.id
    assert msg.usage.output_tokens == 7 and msg.usage.input_tokens > 0
    sent = fake.requests[-1]
    if model == "gpt":  # the provider got OpenAI's tools, unchanged
        assert sent["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
        assert sent["tool_choice"] == "required"
    else:  # the Anthropic provider got Anthropic's tools back
        assert sent["tools"][0]["input_schema"] == WEATHER["input_schema"] and sent[
            "tool_choice"
        ] == {"type": "any"}
    rec = record(env, raw.headers["x-request-id"])
    assert rec["model_used"] == model and rec["completion_tokens"] == 7 and rec["cost_usd"] > 0

    with c.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "input_json_delta" in deltas and "text_delta" in deltas
    assert final.stop_reason == "tool_use" and final.content[1].input == call.input
    assert final.usage.output_tokens == 7

    kw["messages"] = [
        *kw["messages"],
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 21 C"}],
        },
    ]
    kw["tool_choice"] = {"type": "auto"}
    after = c.messages.create(**kw)
    assert after.stop_reason == "end_turn" and after.content[0].type == "text"
    sent = fake.requests[-1]
    if model == "gpt":
        assert sent["messages"][-1] == {
            "role": "tool",
            "tool_call_id": call.id,
            "content": "sunny, 21 C",
        }
        assert sent["messages"][-2]["tool_calls"][0]["id"] == call.id
    else:
        assert sent["messages"][-1]["content"][0] == {
            "type": "tool_result",
            "tool_use_id": call.id,
            "content": "sunny, 21 C",
        }
        assert sent["messages"][-2]["content"][-1]["type"] == "tool_use"


def test_output_config_format_is_response_format(env: Env) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    env.client().messages.create(
        model="gpt",
        max_tokens=8,
        messages=[{"role": "user", "content": "hi"}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    sent = env.fakes["gpt"].requests[-1]
    assert sent["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def test_a_stream_cut_mid_answer_ends_with_an_error_event(env: Env) -> None:
    cut = threading.Event()
    env.fakes["gpt"].faults.append(Fault.drop_after(3, cut))
    got: list[str] = []
    ask = [{"role": "user", "content": "one two three four five"}]
    with (
        pytest.raises(anthropic.APIStatusError) as e,
        env.client().messages.stream(model="gpt", max_tokens=16, messages=ask) as s,
    ):
        for ev in s:
            got.append(ev.type)
            if ev.type == "text":  # the first words reached the client: now the provider drops
                cut.set()
    assert got[0] == "message_start" and "message_stop" not in got
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "api_error"


def test_count_tokens_is_the_usage_of_the_same_request(env: Env) -> None:
    """`messages.count_tokens` on the self-hosted model counts what `messages.create` bills:
    the system prompt and the tools rendered by the model's chat template, included."""
    c = env.client()
    kw: dict[str, Any] = {
        "model": "tiny",
        "system": "Answer as a weather station would.",
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "count me: how warm is Oslo in May?"}],
    }
    counted = c.messages.count_tokens(**kw).input_tokens
    msg = c.messages.create(max_tokens=4, **kw)
    assert counted == msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
    bare = c.messages.count_tokens(model="tiny", messages=kw["messages"]).input_tokens
    assert 0 < bare < counted  # the system prompt and the tool definitions count


def test_count_tokens_refusals_are_typed(env: Env) -> None:
    ask: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.AuthenticationError):
        env.client("sk-duet-nope").messages.count_tokens(model="tiny", messages=ask)
    with pytest.raises(anthropic.NotFoundError) as nf:
        env.client().messages.count_tokens(model="nope", messages=ask)
    assert "nope" in nf.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        env.client().messages.count_tokens(model="tiny", messages=[])
    assert "messages" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as ext:  # no local tokenizer
        env.client().messages.count_tokens(model="gpt", messages=ask)
    assert "external provider" in ext.value.body["error"]["message"]


def test_every_path_under_messages_answers_in_anthropic_shape(env: Env) -> None:
    """Errors the router and the middleware answer before any handler runs (an unknown path, a
    wrong method) parse as the anthropic client's typed errors, with Anthropic's body."""
    with pytest.raises(anthropic.NotFoundError) as nf:
        env.client().messages.batches.retrieve("msgbatch_nope")
    assert nf.value.body["type"] == "error"
    assert nf.value.body["error"]["type"] == "not_found_error"
    assert "/v1/messages/batches/msgbatch_nope" in nf.value.message
    status, headers, got = http(env.gw.url + "/v1/messages", "GET", key=env.key)
    assert status == 405 and got["type"] == "error", got
    assert got["error"]["type"] == "invalid_request_error"
    assert headers.get("request-id", "").startswith("req-")
    with pytest.raises(anthropic.NotFoundError) as model:
        env.client().messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert "nope" in model.value.body["error"]["message"]
    status, _, other = http(env.gw.url + "/v1/nothing-here", "GET", key=env.key)
    assert status == 404 and "type" not in other and other["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    "args, value", [('"Paris"', "Paris"), ("[1, 2]", [1, 2]), ("Paris", "Paris")]
)
def test_arguments_that_are_no_object_are_still_a_tool_use(env: Env, args: str, value: Any) -> None:
    """A call whose arguments are other JSON, or no JSON, is a tool_use block with the
    arguments wrapped as {"value": …}, whole and streamed alike (the fake calls with the text
    after `raw:` as the arguments)."""
    kw = _tool_turns("gpt")
    kw["messages"] = [{"role": "user", "content": f"raw:{args}"}]
    c = env.client()
    msg = c.messages.create(**kw)
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[1].input == {"value": value}
    with c.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.content[1].type == "tool_use" and final.content[1].input == {"value": value}
