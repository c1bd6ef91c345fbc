"""Tools, structured outputs and the penalty and sampling fields end to end: the official
openai client (sync and streamed) → a real gateway → real SmolLM2 nodes, prefill → decode
over the real transport ("smollm2") and one colocated node ("smollm2-colo"), one cluster for
the module. Requests run concurrently; max_tokens stays small.

SmolLM2's chat template has no tools, so the gateway's generic Hermes prompt is what the model
sees (docs/tools.md); a forced tool_choice is enforced by the guide on both legs, so its
arguments always validate against the function's schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from gateway.tools.formats import FORMATS
from gateway.tools.plan import plan_for
from gateway.tools.prompt import render
from gateway.tools.spec import check_tools
from protocol.tools import ToolDef
from tests.gateway.helpers import gateway_proc, http, make_team, metric, tiny_model
from tests.procs import Proc, duet_node, running
from text.tokenizer import Tokenizer

pytestmark = pytest.mark.smollm2
NODE_ARGS = ("--kv-blocks", "512", "--max-model-len", "2048")
MODELS = ["smollm2", "smollm2-colo"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 30},
                "limit": {"type": "integer", "minimum": 1, "maximum": 10},
            },
            "required": ["query", "limit"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {f["function"]["name"]: f["function"]["parameters"] for f in (WEATHER, SEARCH)}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 40}


@pytest.fixture(scope="module")
def gw(
    smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str, tuple[Proc, ...]]]:
    tmp = tmp_path_factory.mktemp("tools")
    p, d, both = (
        duet_node(role, smollm2, tmp, *NODE_ARGS) for role in ("prefill", "decode", "both")
    )
    with running(p, d, both):
        g = gateway_proc(
            tmp,
            {
                "smollm2": tiny_model(smollm2, prefill=[p.url], decode=[d.url]),
                "smollm2-colo": tiny_model(smollm2, both=[both.url]),
            },
        )
        with running(g):
            # the schema corpus runs every schema at once on both layouts: more than a team's
            # default concurrency
            yield g, make_team(g.url, "tools", max_concurrent=256), (p, d, both)


def clients(gw: tuple[Proc, str, tuple[Proc, ...]]) -> tuple[openai.OpenAI, openai.AsyncOpenAI]:
    g, key, _ = gw
    return (
        openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0),
        openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0),
    )


def _valid_call(call: Any) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) > 10
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


async def _streamed(
    client: openai.AsyncOpenAI, **kw: Any
) -> tuple[str, list[dict[str, str]], str | None]:
    """A streamed answer as (content, calls assembled from the deltas, finish_reason); checks
    OpenAI's delta shape: a call's first delta has its id, type and name, later ones only
    arguments."""
    content, calls, finish = "", [], None
    async for chunk in await client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or ():
                if tc.index == len(calls):
                    assert (
                        tc.id
                        and tc.id.startswith("call_")
                        and tc.type == "function"
                        and tc.function.name
                    )
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


async def test_forced_tool_choice_gives_a_schema_valid_call(
    gw: tuple[Proc, str, tuple[Proc, ...]],
) -> None:
    sync, client = clients(gw)
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"messages": ASK, "tools": [WEATHER, SEARCH], **GREEDY}
    results = await asyncio.gather(
        *(
            job
            for m in MODELS
            for job in (
                asyncio.to_thread(
                    sync.chat.completions.create, model=m, tool_choice=named, **kw
                ),  # the sync client too
                client.chat.completions.create(model=m, tool_choice="required", **kw),
                _streamed(client, model=m, tool_choice=named, **kw),
            )
        )
    )
    for whole, required, (content, calls, finish) in zip(
        results[::3], results[1::3], results[2::3], strict=True
    ):
        for answer in (whole, required):
            ch = answer.choices[0]
            assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
            assert len(ch.message.tool_calls) == 1
            _valid_call(ch.message.tool_calls[0])
        assert whole.choices[0].message.tool_calls[0].function.name == "get_weather"
        assert (
            finish == "tool_calls"
            and content == ""
            and len(calls) == 1
            and calls[0]["name"] == "get_weather"
        )
        jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_weather"])


async def test_auto_gives_text_or_a_valid_call(gw: tuple[Proc, str, tuple[Proc, ...]]) -> None:
    _, client = clients(gw)
    asks = [ASK, [{"role": "user", "content": "Say hello."}]]
    jobs = [(m, a) for m in MODELS for a in asks]
    (*answers,) = await asyncio.gather(
        *(
            client.chat.completions.create(model=m, messages=a, tools=[WEATHER, SEARCH], **GREEDY)
            for m, a in jobs
        ),
        *(
            _streamed(client, model=m, messages=a, tools=[WEATHER, SEARCH], **GREEDY)
            for m, a in jobs
        ),
    )
    for r in answers[: len(jobs)]:
        ch = r.choices[0]
        if ch.message.tool_calls:
            assert ch.finish_reason == "tool_calls"
            for call in ch.message.tool_calls:
                json.loads(call.function.arguments)  # never half JSON
        else:
            assert isinstance(ch.message.content, str) and ch.finish_reason in ("stop", "length")
            assert (
                "<tool_call>\n{" not in ch.message.content or "</tool_call>" in ch.message.content
            )
    # streamed (batched differently, so not token-equal to the whole answers): the same rules
    for content, calls, finish in answers[len(jobs) :]:
        assert (finish == "tool_calls") == bool(calls), (content, calls, finish)
        for call in calls:
            json.loads(call["arguments"])


async def test_a_conversation_with_a_tool_result_continues(
    gw: tuple[Proc, str, tuple[Proc, ...]], smollm2: Path
) -> None:
    _, client = clients(gw)
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc123",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius"}',
                    },
                }
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "call_abc123",
            "content": '{"temperature": 21, "sky": "clear"}',
        },
    ]
    r, (content, _, finish) = await asyncio.gather(
        client.chat.completions.create(
            model="smollm2", messages=messages, tools=[WEATHER], tool_choice="none", **GREEDY
        ),
        _streamed(
            client,
            model="smollm2-colo",
            messages=messages,
            tools=[WEATHER],
            tool_choice="none",
            **GREEDY,
        ),
    )
    ch = r.choices[0]
    assert (
        ch.message.tool_calls is None
        and ch.message.content
        and ch.finish_reason in ("stop", "length")
    )
    assert content and finish in ("stop", "length")
    # the model saw the call and its result, as the generic Hermes prompt writes them
    tok = Tokenizer(smollm2)
    plan = plan_for(check_tools([openai_tool(WEATHER)], "none", None), None, tok.chat_template)
    text = render(tok, [*ASK, _as_turn(messages[1]), messages[2]], plan)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>' in text
    )
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def openai_tool(t: dict[str, Any]) -> ToolDef:
    import msgspec

    return msgspec.convert(t, ToolDef)


def _as_turn(m: dict[str, Any]) -> dict[str, Any]:
    return {**m, "content": m["content"] or ""}


async def test_json_object_and_schemas(gw: tuple[Proc, str, tuple[Proc, ...]]) -> None:
    _, client = clients(gw)
    schemas = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
            },
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "colour": {"enum": ["red", "green", "blue"]},
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 8},
                    "minItems": 1,
                    "maxItems": 3,
                },
            },
            "required": ["colour", "tags"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "point": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": -5, "maximum": 5},
                        "y": {"type": "integer", "minimum": -5, "maximum": 5},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
            },
            "required": ["point", "code"],
            "additionalProperties": False,
        },
    ]
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    obj_ask = [{"role": "user", "content": 'What is 2+2? Answer as {"answer": n}.'}]
    jobs = [(m, i) for m in MODELS for i in range(len(schemas))]
    streamed, *rest = await asyncio.gather(
        _streamed(
            client,
            model="smollm2",
            messages=ask,
            **GREEDY,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "s0", "schema": schemas[0]},
            },
        ),
        *(
            client.chat.completions.create(
                model=m,
                response_format={"type": "json_object"},
                temperature=0,
                max_tokens=96,
                messages=obj_ask,
            )
            for m in MODELS
        ),
        *(
            client.chat.completions.create(
                model=m,
                messages=ask,
                **GREEDY,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": f"s{i}", "schema": schemas[i], "strict": True},
                },
            )
            for m, i in jobs
        ),
    )
    objs, answers = rest[: len(MODELS)], rest[len(MODELS) :]
    for obj in objs:
        assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    for (_, i), r in zip(jobs, answers, strict=True):
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schemas[i])
    content, _, finish = streamed
    assert finish == "stop"
    jsonschema.validate(json.loads(content), schemas[0])


async def test_max_tokens_cutting_the_json_is_length(
    gw: tuple[Proc, str, tuple[Proc, ...]],
) -> None:
    """OpenAI's behaviour: a JSON answer cut by max_tokens is a prefix with finish_reason length."""
    _, client = clients(gw)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
    }
    kw: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "temperature": 0,
        "max_tokens": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    *whole, (content, _, finish) = await asyncio.gather(
        *(client.chat.completions.create(model=m, **kw) for m in MODELS),
        _streamed(client, model="smollm2", **kw),
    )
    for text, reason in [
        *((r.choices[0].message.content, r.choices[0].finish_reason) for r in whole),
        (content, finish),
    ]:
        assert reason == "length" and text.startswith("{"), (text, reason)
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


async def test_the_schema_corpus_on_both_layouts(gw: tuple[Proc, str, tuple[Proc, ...]]) -> None:
    corpus = Path(__file__).parents[2] / "bench" / "data" / "json_schemas.json"
    schemas: dict[str, Any] = json.loads(corpus.read_text())
    assert len(schemas) >= 40
    _, client = clients(gw)
    ask = [{"role": "user", "content": "Answer with a JSON value."}]
    jobs = [(name, model) for name in schemas for model in MODELS]
    answers = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=model,
                messages=ask,
                temperature=0,
                max_tokens=200,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": name, "schema": schemas[name]},
                },
            )
            for name, model in jobs
        )
    )
    cut = [
        (name, model, r.choices[0].message.content)
        for (name, model), r in zip(jobs, answers, strict=True)
        if r.choices[0].finish_reason == "length"
    ]
    # Every answer of the corpus has a bounded length: strings have maxLength or a pattern,
    # arrays maxItems, and a number with bounds at most 10 fraction digits (text/json_bounds.py;
    # before, "price" in [0, 100] allowed 99.9999… for ever, and greedy bf16 output, which depends
    # on the batch it ran in, now and then ran its digits into max_tokens). So no cut, ever.
    assert not cut, cut
    for (name, model), r in zip(jobs, answers, strict=True):
        assert r.choices[0].finish_reason == "stop", (name, model, r.choices[0].message.content)
        jsonschema.validate(json.loads(r.choices[0].message.content), schemas[name])


async def test_penalties_reduce_a_greedy_repetition(gw: tuple[Proc, str, tuple[Proc, ...]]) -> None:
    _, client = clients(gw)
    kw = {"prompt": "Yes! Yes! Yes! Yes! Yes!", "temperature": 0, "max_tokens": 24}
    plain, freq, pres, rep = await asyncio.gather(
        *(
            client.completions.create(model=m, **kw, **extra)
            for m, extra in (
                ("smollm2", {}),
                ("smollm2", {"frequency_penalty": 2.0}),
                ("smollm2-colo", {"presence_penalty": 2.0}),
                ("smollm2", {"extra_body": {"repetition_penalty": 2.0}}),
            )
        )
    )
    count = lambda r: r.choices[0].text.count("Yes")  # noqa: E731
    assert count(plain) >= 8, plain.choices[
        0
    ].text  # greedy SmolLM2 goes on repeating (12 times here)
    for r in (freq, pres, rep):
        assert count(r) < count(plain), (r.choices[0].text, plain.choices[0].text)


async def test_min_p_applies_on_both_legs(gw: tuple[Proc, str, tuple[Proc, ...]]) -> None:
    """min_p 1 keeps only the likeliest token, so at temperature 1 the answer is the greedy one:
    on D's tokens (plain text) and on P's first token (a guided answer, which P samples)."""
    _, client = clients(gw)
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}},
        "required": ["name"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}
    kw: dict[str, Any] = {"model": "smollm2", "messages": ask, "max_tokens": 16}
    # one at a time: bf16 greedy output may depend on the batch a request ran in
    greedy = await client.chat.completions.create(**kw, temperature=0)
    sampled = await client.chat.completions.create(
        **kw, temperature=1.0, seed=7, extra_body={"min_p": 1.0}
    )
    g_guided = await client.chat.completions.create(**kw, temperature=0, response_format=fmt)
    s_guided = await client.chat.completions.create(
        **kw, temperature=1.0, seed=7, response_format=fmt, extra_body={"min_p": 1.0}
    )
    assert sampled.choices[0].message.content == greedy.choices[0].message.content
    assert s_guided.choices[0].message.content == g_guided.choices[0].message.content


async def test_logit_bias_bans_and_forces_a_token(
    gw: tuple[Proc, str, tuple[Proc, ...]], smollm2: Path
) -> None:
    _, client = clients(gw)
    tok = Tokenizer(smollm2)
    kw = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 8,
    }
    plain = await client.chat.completions.create(model="smollm2", **kw)
    first = tok.encode(plain.choices[0].message.content, add_special_tokens=False)[0]
    forced = tok.encode(" banana", add_special_tokens=False)[0]
    banned, pushed = await asyncio.gather(
        client.chat.completions.create(model="smollm2", logit_bias={str(first): -100}, **kw),
        client.chat.completions.create(model="smollm2-colo", logit_bias={str(forced): 100}, **kw),
    )
    assert tok.encode(banned.choices[0].message.content, add_special_tokens=False)[0] != first
    assert pushed.choices[0].message.content == tok.decode([forced] * 8)


def test_bad_schemas_and_values_are_400_before_any_node_work(
    gw: tuple[Proc, str, tuple[Proc, ...]],
) -> None:
    g, key, nodes = gw
    before = sum(metric(n.url, "duet:prompt_tokens") for n in nodes)
    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frobnicate"}},
                }
            },
            "response_format",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "string", "pattern": "(unclosed"},
                    },
                }
            },
            "response_format",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": {"1": -101}}, "logit_bias"),
    ]
    for extra, param in cases:
        s, _, body = http(
            g.url + "/v1/chat/completions",
            "POST",
            {"model": "smollm2", "messages": ASK, **extra},
            key=key,
        )
        assert s == 400 and body["error"]["param"] == param, (extra, body)
    assert sum(metric(n.url, "duet:prompt_tokens") for n in nodes) == before
    assert set(FORMATS) == {"hermes", "llama3_json"}
