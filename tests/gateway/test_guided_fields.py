"""vLLM's structured-output extras on the public API, end to end: the official openai client
(`extra_body`, sync and streamed) → a real gateway → real SmolLM2 prefill and decode nodes over
the real transport. `guided_choice` / `guided_regex` / `guided_json` and `structured_outputs`
(`choice`, `regex`, `json`) become the same guide `response_format` does
(gateway/serving/constraint.py), so the prefill node masks the first token and the decode node the
rest; a bad one is a 400 naming its field before any node work, and so are vLLM's older
`guided_grammar` and `guided_whitespace_pattern`, whose 400 says what to send instead;
`guided_decoding_backend` is taken and changes nothing. max_tokens stays small."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.gateway.helpers import gateway_proc, make_team, metric, tiny_model
from tests.procs import Proc, duet_node, running

pytestmark = pytest.mark.smollm2
MODEL = "smollm2"
CHOICES = ["yes", "no", "maybe"]
ASK = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
CODE = r"[0-9]{3}-[a-z]{2,4}"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
Env = tuple[Proc, str, tuple[Proc, Proc]]


@pytest.fixture(scope="module")
def env(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("guided")
    args = ("--kv-blocks", "256", "--max-model-len", "1024")
    p, d = (duet_node(role, smollm2, tmp, *args) for role in ("prefill", "decode"))
    with running(p, d):
        g = gateway_proc(tmp, {MODEL: tiny_model(smollm2, prefill=[p.url], decode=[d.url])})
        with running(g):
            yield g, make_team(g.url, "guided"), (p, d)


def _client(env: Env) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=env[0].url + "/v1", api_key=env[1], max_retries=0)


async def _chat_streamed(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, str | None]:
    text, finish = "", None
    async for chunk in await client.chat.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


async def _completion_streamed(client: openai.AsyncOpenAI, **kw: Any) -> tuple[str, str | None]:
    text, finish = "", None
    async for chunk in await client.completions.create(model=MODEL, stream=True, **kw):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def _assert_people(chat: Any, completion: Any, streamed: tuple[str, str | None]) -> None:
    """A whole chat answer, a completion and a streamed chat each ended on their own ("stop") with
    JSON valid against PERSON (the stream is batched differently, so not always token-equal to
    the whole answer: valid too)."""
    assert chat.choices[0].finish_reason == "stop", chat.choices[0]
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON)
    assert completion.choices[0].finish_reason == "stop", completion.choices[0]
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON)
    text, finish = streamed
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


async def test_guided_choice_answers_exactly_one_choice(env: Env) -> None:
    client = _client(env)
    choice = {"guided_choice": CHOICES}
    new_form = {"structured_outputs": {"choice": CHOICES}}
    prompt = "Q: Is the sky blue?\nA:"
    greedy, sampled, streamed, completion, completion_streamed = await asyncio.gather(
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=8, temperature=0, extra_body=choice
        ),
        client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=8,
            temperature=1.0,
            seed=7,
            n=3,
            extra_body=new_form,
        ),
        _chat_streamed(client, messages=ASK, max_tokens=8, temperature=0, extra_body=choice),
        client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=new_form
        ),
        _completion_streamed(
            client, prompt=prompt, max_tokens=8, temperature=1.0, seed=3, extra_body=choice
        ),
    )
    for c in (*greedy.choices, *sampled.choices):
        assert c.message.content in CHOICES and c.finish_reason == "stop", c
    assert completion.choices[0].text in CHOICES and completion.choices[0].finish_reason == "stop"
    for text, finish in (streamed, completion_streamed):
        assert text in CHOICES and finish == "stop", (text, finish)


async def test_guided_regex_answer_fullmatches(env: Env) -> None:
    client = _client(env)
    ask = [{"role": "user", "content": "Invent a product code like 123-abc."}]
    whole, streamed, completion = await asyncio.gather(
        client.chat.completions.create(
            model=MODEL,
            messages=ask,
            max_tokens=16,
            temperature=0,
            extra_body={"guided_regex": CODE},
        ),
        _chat_streamed(
            client,
            messages=ask,
            max_tokens=16,
            temperature=1.0,
            seed=11,
            extra_body={"guided_regex": CODE},
        ),
        _completion_streamed(
            client,
            prompt="Product code:",
            max_tokens=16,
            temperature=0,
            extra_body={"structured_outputs": {"regex": CODE}},
        ),
    )
    text = whole.choices[0].message.content
    assert re.fullmatch(CODE, text) and whole.choices[0].finish_reason == "stop", whole.choices[0]
    for text, finish in (streamed, completion):
        assert re.fullmatch(CODE, text) and finish == "stop", (text, finish)


async def test_structured_outputs_json_gives_schema_valid_json(env: Env) -> None:
    client = _client(env)
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    inline, as_text, streamed = await asyncio.gather(
        client.chat.completions.create(
            model=MODEL,
            messages=ask,
            max_tokens=40,
            temperature=0,
            extra_body={"structured_outputs": {"json": PERSON}},
        ),
        client.completions.create(
            model=MODEL,
            prompt="A person as JSON:",
            max_tokens=40,
            temperature=0,
            extra_body={"structured_outputs": {"json": json.dumps(PERSON)}},
        ),
        _chat_streamed(
            client,
            messages=ask,
            max_tokens=40,
            temperature=0,
            extra_body={"structured_outputs": {"json": PERSON}},
        ),
    )
    _assert_people(inline, as_text, streamed)


async def test_guided_json_gives_schema_valid_json(env: Env) -> None:
    """vLLM's older guided_json (LangChain's VLLMOpenAI, older vLLM examples): the schema inline
    or as its JSON text, with or without vLLM's inert guided_decoding_backend."""
    client = _client(env)
    ask = [{"role": "user", "content": "Describe a person as JSON."}]
    inline, as_text, streamed = await asyncio.gather(
        client.chat.completions.create(
            model=MODEL,
            messages=ask,
            max_tokens=40,
            temperature=0,
            extra_body={"guided_json": PERSON},
        ),
        client.completions.create(
            model=MODEL,
            prompt="A person as JSON:",
            max_tokens=40,
            temperature=0,
            extra_body={"guided_json": json.dumps(PERSON), "guided_decoding_backend": "xgrammar"},
        ),
        _chat_streamed(
            client,
            messages=ask,
            max_tokens=40,
            temperature=1.0,
            seed=5,
            extra_body={"guided_json": PERSON, "guided_decoding_backend": "guidance"},
        ),
    )
    _assert_people(inline, as_text, streamed)


async def test_guided_decoding_backend_alone_changes_nothing(env: Env) -> None:
    client = _client(env)
    plain, with_backend = await asyncio.gather(
        client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0),
        client.completions.create(
            model=MODEL,
            prompt="The sky is",
            max_tokens=6,
            temperature=0,
            extra_body={"guided_decoding_backend": "outlines"},
        ),
    )
    assert with_backend.choices[0].text == plain.choices[0].text


TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"guided_choice": []}, "guided_choice", "the list of choices is empty"),
    ({"guided_choice": ["yes", ""]}, "guided_choice", "choice 1 is empty"),
    (
        {"guided_choice": ["x" * 1001]},
        "guided_choice",
        "choice 0 is 1001 characters long; at most 1000",
    ),
    ({"guided_choice": [str(i) for i in range(1001)]}, "guided_choice", "at most 1000 choices"),
    ({"guided_regex": "(unclosed"}, "guided_regex", "unclosed group"),
    ({"guided_regex": ""}, "guided_regex", "the regular expression is empty"),
    (
        {"structured_outputs": {"choice": []}},
        "structured_outputs.choice",
        "the list of choices is empty",
    ),
    (
        {"structured_outputs": {"regex": "[a-"}},
        "structured_outputs.regex",
        "unclosed character class",
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
    ({"structured_outputs": {}}, "structured_outputs", "exactly one of"),
    (
        {"structured_outputs": {"grammar": "root ::= 'a'"}},
        "structured_outputs.grammar",
        "is not supported",
    ),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "cannot be combined"),
    (
        {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
        "guided_choice",
        "cannot be combined",
    ),
    (
        {"structured_outputs": {"regex": "a"}, "tools": [TOOL], "tool_choice": "required"},
        "tool_choice",
        "structured_outputs and a forced tool_choice",
    ),
    (
        {"guided_choice": ["a"], "min_tokens": 2},
        "min_tokens",
        "cannot be combined with guided_choice",
    ),
    # vLLM's older guided_json: the same checks as structured_outputs.json, and one constraint
    ({"guided_json": {"type": "frobnicate"}}, "guided_json", "Invalid type"),
    ({"guided_json": "{not json"}, "guided_json", "guided_json is a string but not JSON"),
    ({"guided_json": 7}, "guided_json", "Expected `bool | str | object | null`"),
    (
        {"guided_json": PERSON, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "guided_json and structured_outputs cannot be combined",
    ),
    (
        {"guided_json": PERSON, "response_format": {"type": "json_object"}},
        "guided_json",
        "response_format and guided_json cannot be combined",
    ),
    (
        {"guided_json": PERSON, "tools": [TOOL], "tool_choice": "required"},
        "tool_choice",
        "guided_json and a forced tool_choice",
    ),
    # vLLM's older fields duet does not serve: refused by name, saying what to send instead
    (
        {"guided_grammar": "root ::= 'a'"},
        "guided_grammar",
        "send guided_json, guided_regex or guided_choice",
    ),
    ({"guided_grammar": "root ::= 'a'", "guided_json": PERSON}, "guided_grammar", "not grammars"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern", "always compact"),
    ({"guided_decoding_backend": 3}, "guided_decoding_backend", "Expected `str | null`"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_bad_fields_are_400s_naming_the_field_before_any_node_work(
    env: Env, extra: dict[str, Any], param: str, words: str
) -> None:
    g, key, nodes = env
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    before = sum(metric(n.url, "duet:prompt_tokens") for n in nodes)
    body = {k: v for k, v in extra.items() if k not in ("tools", "tool_choice")}
    tools = {k: v for k, v in extra.items() if k in ("tools", "tool_choice")}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=4, extra_body=body, **tools
        )
    assert e.value.status_code == 400 and e.value.param == param and words in e.value.message, (
        e.value.body
    )
    assert e.value.type == "invalid_request_error"
    if "tools" not in extra:  # the completions form checks the same fields the same way
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body=body)
        assert e.value.param == param and words in e.value.message, e.value.body
    assert sum(metric(n.url, "duet:prompt_tokens") for n in nodes) == before
