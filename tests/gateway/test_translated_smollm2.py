"""`/v1/messages` and `/v1/responses` on the real default model: SmolLM2 on a real node, the
official `anthropic` and `openai` clients. Both APIs are translations onto the chat path, so
greedy answers equal the chat endpoint's, whole and streamed, and a forced tool choice gives a
call whose input validates against the tool's schema (the chat path's guide, gateway/tools/).

vLLM's request extras (sent through `extra_body`) are taken there as on chat: a
structured-output extra constrains the answer, whole and streamed (`guided_choice`: one of the
choices; `structured_outputs.json` / `guided_json`: schema-valid JSON; `guided_regex`: a full
match), a sampling extra steers it as on chat, and a bad one — or one beside the API's own
constraint (`output_config.format`, `text.format`, a forced tool_choice) — is a 400 naming the
field(s) before any node work."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team, metric, tiny_model
from tests.procs import duet_node, running

pytestmark = pytest.mark.smollm2
# float32: with this system prompt the first answer token is a near-tie ("The" -1.7342 vs "La"
# -1.7358 in fp32 logits), which bf16 rounding decides either way (the AVX-512 prefill attention
# said "The" by 0.001, the AMX one says "La" by 0.03); the test is about the translations being
# equal to the chat endpoint, not about which way bf16 breaks a tie.
COMMON = ("--kv-blocks", "256", "--max-model-len", "2048", "--dtype", "float32")
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}


@dataclass
class Clients:
    oai: openai.OpenAI
    claude: anthropic.Anthropic
    node_url: str


@pytest.fixture(scope="module")
def clients(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Clients]:
    tmp = tmp_path_factory.mktemp("translated-smollm2")
    node = duet_node("both", smollm2, tmp, *COMMON, threads=None)
    gw = gateway_proc(tmp, {"smollm2": tiny_model(smollm2, both=[node.url])})
    with running(node, gw):
        key = make_team(gw.url, "smol")
        yield Clients(
            openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=gw.url, api_key=key, max_retries=0, timeout=120),
            node.url,
        )


def test_text_equals_the_chat_endpoints(clients: Clients) -> None:
    oai, claude = clients.oai, clients.claude
    system, question = "You are a concise assistant.", "What is the capital of France?"
    chat = oai.chat.completions.create(
        model="smollm2",
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
    )
    expected = chat.choices[0].message.content
    assert "Paris" in expected

    # this SDK has no temperature argument any more (the API's older field): sent as extra_body
    kw = {
        "model": "smollm2",
        "max_tokens": 24,
        "extra_body": {"temperature": 0},
        "system": system,
        "messages": [{"role": "user", "content": question}],
    }
    msg = claude.messages.create(**kw)
    assert msg.content[0].text == expected
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens
    assert msg.stop_reason == (
        "max_tokens" if chat.choices[0].finish_reason == "length" else "end_turn"
    )
    with claude.messages.stream(**kw) as stream:
        assert "".join(stream.text_stream) == expected

    r = oai.responses.create(
        model="smollm2", instructions=system, input=question, max_output_tokens=24, temperature=0
    )
    assert r.output_text == expected and r.usage.output_tokens == chat.usage.completion_tokens
    streamed = "".join(
        e.delta
        for e in oai.responses.create(
            model="smollm2",
            instructions=system,
            input=question,
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
        if e.type == "response.output_text.delta"
    )
    assert streamed == expected


def test_forced_tool_choice_gives_a_schema_valid_call(clients: Clients) -> None:
    ask = "What is the weather in Paris?"
    tool = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
    kw: dict[str, Any] = {
        "model": "smollm2",
        "max_tokens": 48,
        "tools": [tool],
        "extra_body": {"temperature": 0},
        "messages": [{"role": "user", "content": ask}],
    }
    msg = clients.claude.messages.create(**kw, tool_choice={"type": "tool", "name": "get_weather"})
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(calls) == 1 and calls[0].name == "get_weather", msg
    jsonschema.validate(calls[0].input, SCHEMA)
    # streamed: Anthropic's events, the arguments as input_json_delta, the same call
    with clients.claude.messages.stream(**kw, tool_choice={"type": "any"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    assert any(
        e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events
    )
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert (
        final.stop_reason == "tool_use" and len(streamed) == 1 and final.usage.output_tokens > 0
    ), final
    jsonschema.validate(streamed[0].input, SCHEMA)
    # the tool's result goes back as a tool_result block and the conversation continues
    kw["messages"] = [
        *kw["messages"],
        {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": "21 C, clear"}
            ],
        },
    ]
    after = clients.claude.messages.create(**kw, tool_choice={"type": "none"})
    assert after.stop_reason in ("end_turn", "max_tokens") and after.content[0].type == "text", (
        after
    )
    assert after.content[0].text
    fn = {
        "type": "function",
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": SCHEMA,
    }
    r = clients.oai.responses.create(
        model="smollm2",
        input=ask,
        tools=[fn],
        max_output_tokens=48,
        tool_choice={"type": "function", "name": "get_weather"},
    )
    fc = [o for o in r.output if o.type == "function_call"]
    assert len(fc) == 1 and fc[0].name == "get_weather", r
    jsonschema.validate(json.loads(fc[0].arguments), SCHEMA)


# -- vLLM's request extras --------------------------------------------------------------------

CHOICES = ["yes", "no", "maybe"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CODE = r"[0-9]{3}-[a-z]{2,4}"


def _message(
    c: Clients, ask: str, extra: dict[str, Any], max_tokens: int
) -> tuple[anthropic.types.Message, str]:
    """A whole /v1/messages answer and the same request streamed (its text)."""
    kw: dict[str, Any] = {
        "model": "smollm2",
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": ask}],
        "extra_body": {"temperature": 0, **extra},
    }
    with c.claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        assert stream.get_final_message().stop_reason == "end_turn"
    return c.claude.messages.create(**kw), streamed


def _response(c: Clients, ask: str, extra: dict[str, Any], max_tokens: int) -> tuple[Any, str]:
    """A whole /v1/responses answer and the same request streamed (its text)."""
    kw: dict[str, Any] = {
        "model": "smollm2",
        "input": ask,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "extra_body": extra,
    }
    events = list(c.oai.responses.create(**kw, stream=True))
    assert events[-1].type == "response.completed", events[-1]
    return c.oai.responses.create(**kw), "".join(
        e.delta for e in events if e.type == "response.output_text.delta"
    )


@pytest.mark.parametrize(
    "extra", [{"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}}]
)
def test_guided_choice_answers_one_of_the_choices(clients: Clients, extra: dict[str, Any]) -> None:
    ask = "Is the sky green? Answer in one sentence."
    msg, streamed = _message(clients, ask, extra, 8)
    assert msg.stop_reason == "end_turn" and msg.content[0].text in CHOICES, msg
    assert streamed in CHOICES
    r, streamed = _response(clients, ask, extra, 8)
    assert r.status == "completed" and r.output_text in CHOICES, r
    assert streamed in CHOICES


@pytest.mark.parametrize(
    "extra",
    [
        {"structured_outputs": {"json": PERSON}},
        {"guided_json": json.dumps(PERSON), "guided_decoding_backend": "xgrammar"},
    ],
)
def test_json_extras_give_schema_valid_json(clients: Clients, extra: dict[str, Any]) -> None:
    ask = "Describe a person."
    msg, streamed = _message(clients, ask, extra, 40)
    assert msg.stop_reason == "end_turn", msg
    for text in (msg.content[0].text, streamed):
        jsonschema.validate(json.loads(text), PERSON)
    r, streamed = _response(clients, ask, extra, 40)
    assert r.status == "completed", r
    for text in (r.output_text, streamed):
        jsonschema.validate(json.loads(text), PERSON)


def test_guided_regex_answer_fullmatches(clients: Clients) -> None:
    ask = "Invent a product code like 123-abc."
    msg, streamed = _message(clients, ask, {"guided_regex": CODE}, 16)
    r, r_streamed = _response(clients, ask, {"structured_outputs": {"regex": CODE}}, 16)
    for text in (msg.content[0].text, streamed, r.output_text, r_streamed):
        assert re.fullmatch(CODE, text), text


def test_sampling_extras_steer_as_on_chat(clients: Clients) -> None:
    """repetition_penalty changes SmolLM2's greedy answer; through either API it is chat's
    answer with the same penalty. min_p 1 at temperature 1 keeps only the likeliest token:
    greedy."""
    ask = "Say 'yes' ten times."
    chat = lambda **extra: (  # noqa: E731
        clients.oai.chat.completions.create(
            model="smollm2",
            max_tokens=24,
            temperature=0,
            messages=[{"role": "user", "content": ask}],
            extra_body=extra,
        )
        .choices[0]
        .message.content
    )
    plain, penalized = chat(), chat(repetition_penalty=2.0)
    assert penalized != plain
    extra = {"repetition_penalty": 2.0}
    assert (
        clients.claude.messages.create(
            model="smollm2",
            max_tokens=24,
            messages=[{"role": "user", "content": ask}],
            extra_body={"temperature": 0, **extra},
        )
        .content[0]
        .text
        == penalized
    )
    assert (
        clients.oai.responses.create(
            model="smollm2", input=ask, max_output_tokens=24, temperature=0, extra_body=extra
        ).output_text
        == penalized
    )
    greedy = {"temperature": 1.0, "min_p": 1.0}
    assert (
        clients.claude.messages.create(
            model="smollm2",
            max_tokens=24,
            messages=[{"role": "user", "content": ask}],
            extra_body=greedy,
        )
        .content[0]
        .text
        == plain
    )
    assert (
        clients.oai.responses.create(
            model="smollm2",
            input=ask,
            max_output_tokens=24,
            temperature=1.0,
            extra_body={"top_k": 1},
        ).output_text
        == plain
    )


TOOL = {"name": "get_weather", "description": "The weather in a city", "input_schema": SCHEMA}
FN = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": SCHEMA,
}
#: (extra_body, the param chat's 400 names, words in the message) — the same on both APIs
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"guided_choice": []}, "guided_choice", "the list of choices is empty"),
    ({"guided_choice": "yes"}, "guided_choice", "Expected `array | null`, got `str`"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    (
        {"structured_outputs": {"regex": 3}},
        "structured_outputs.regex",
        "Expected `str | null`, got `int`",
    ),
    (
        {"structured_outputs": {"json": {"type": "frobnicate"}}},
        "structured_outputs.json",
        "Invalid type",
    ),
    (
        {"structured_outputs": {"regex": "a", "choice": ["b"]}},
        "structured_outputs",
        "exactly one of",
    ),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is a string but not JSON"),
    (
        {"guided_grammar": "root ::= 'a'"},
        "guided_grammar",
        "send guided_json, guided_regex or guided_choice",
    ),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "always compact"),
    ({"guided_decoding_backend": 3}, "guided_decoding_backend", "Expected `str | null`"),
    (
        {"guided_choice": ["a", "b"], "guided_regex": "b"},
        "guided_choice",
        "guided_regex and guided_choice cannot be combined",
    ),
    (
        {"guided_choice": ["a"], "min_tokens": 2},
        "min_tokens",
        "cannot be combined with guided_choice",
    ),
    ({"min_p": 1.5}, "min_p", "min_p must be between 0 and 1"),
    (
        {"repetition_penalty": 0},
        "repetition_penalty",
        "repetition_penalty must be between 0.01 and 100",
    ),
]
#: two constraints, one of them the API's own: (its fields, the extra, param, the message)
MESSAGES_TWO: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (
        {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
        {"guided_json": PERSON},
        "output_config.format and guided_json cannot be combined",
    ),
    (
        {"tools": [TOOL], "tool_choice": {"type": "any"}},
        {"guided_choice": CHOICES},
        "guided_choice and a forced tool_choice (any or a named tool) cannot be combined",
    ),
    (
        {"tools": [TOOL], "tool_choice": {"type": "tool", "name": "get_weather"}},
        {"structured_outputs": {"regex": "a"}},
        "structured_outputs and a forced tool_choice (any or a named tool) cannot be combined",
    ),
]
RESPONSES_TWO: list[tuple[dict[str, Any], dict[str, Any], str, str]] = [
    (
        {"text": {"format": {"type": "json_schema", "name": "city", "schema": SCHEMA}}},
        {"guided_choice": CHOICES},
        "guided_choice",
        "text.format and guided_choice cannot be combined",
    ),
    (
        {"text": {"format": {"type": "json_object"}}},
        {"structured_outputs": {"json_object": True}},
        "structured_outputs",
        "text.format and structured_outputs cannot be combined",
    ),
    (
        {"tools": [FN], "tool_choice": "required"},
        {"guided_regex": "a+"},
        "tool_choice",
        "guided_regex and a forced tool_choice (required or a named function) cannot be combined",
    ),
]


def _no_node_work(c: Clients) -> float:
    return metric(c.node_url, "duet:prompt_tokens")


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_extras_are_400s_naming_the_field(
    clients: Clients, extra: dict[str, Any], param: str, words: str
) -> None:
    """Chat's checks and words: Anthropic's error shape has no param, so its message names the
    field; the Responses API's error carries chat's param too."""
    before = _no_node_work(clients)
    with pytest.raises(anthropic.BadRequestError) as a:
        clients.claude.messages.create(
            model="smollm2",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body=extra,
        )
    err = a.value.body["error"]
    assert err["type"] == "invalid_request_error" and words in err["message"], err
    assert param in err["message"], err
    with pytest.raises(openai.BadRequestError) as o:
        clients.oai.responses.create(
            model="smollm2", input="Hi", max_output_tokens=8, extra_body=extra
        )
    assert o.value.param == param and words in o.value.message, o.value.body
    assert _no_node_work(clients) == before


@pytest.mark.parametrize(("own", "extra", "words"), MESSAGES_TWO)
def test_messages_refuses_an_extra_beside_its_own_constraint(
    clients: Clients, own: dict[str, Any], extra: dict[str, Any], words: str
) -> None:
    before = _no_node_work(clients)
    with pytest.raises(anthropic.BadRequestError) as a:
        clients.claude.messages.create(
            model="smollm2",
            max_tokens=8,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body=extra,
            **own,
        )
    assert words in a.value.body["error"]["message"], a.value.body
    assert _no_node_work(clients) == before


@pytest.mark.parametrize(("own", "extra", "param", "words"), RESPONSES_TWO)
def test_responses_refuses_an_extra_beside_its_own_constraint(
    clients: Clients, own: dict[str, Any], extra: dict[str, Any], param: str, words: str
) -> None:
    before = _no_node_work(clients)
    with pytest.raises(openai.BadRequestError) as o:
        clients.oai.responses.create(
            model="smollm2", input="Hi", max_output_tokens=8, extra_body=extra, **own
        )
    assert o.value.param == param and words in o.value.message, o.value.body
    assert _no_node_work(clients) == before


# -- LangChain's chat models: a @tool's schema leaves additionalProperties out ------------------


def test_langchain_bind_tools_gives_a_valid_call_on_both_apis(clients: Clients) -> None:
    """LangChain's `@tool` writes `{"properties": ..., "required": ..., "type": "object"}` with
    no `additionalProperties`; the gateway closes such objects (text/json_closed.py), so a forced
    call through ChatOpenAI (/v1/chat/completions) and ChatAnthropic (/v1/messages) names the
    tool's arguments and nothing else, as JSON that parses."""
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "sunny"

    schema = get_weather.tool_call_schema.model_json_schema()
    assert "additionalProperties" not in schema  # what the test is about
    closed = {**schema, "additionalProperties": False}
    oai, claude = clients.oai, clients.claude
    models = [
        ChatOpenAI(
            model="smollm2",
            base_url=str(oai.base_url),
            api_key=oai.api_key,
            temperature=0,
            max_tokens=48,
            max_retries=0,
        ),
        ChatAnthropic(
            model="smollm2",
            base_url=str(claude.base_url),
            api_key=claude.api_key,
            temperature=0,
            max_tokens=48,
            max_retries=0,
        ),
    ]
    for chat in models:
        bound = chat.bind_tools([get_weather], tool_choice="get_weather")
        reply = bound.invoke("What is the weather in Paris?")
        assert [c["name"] for c in reply.tool_calls] == ["get_weather"], (chat, reply)
        assert not reply.invalid_tool_calls, reply
        jsonschema.validate(reply.tool_calls[0]["args"], closed)
