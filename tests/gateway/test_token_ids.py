"""vLLM's token ids on the OpenAI endpoints and constraints on the render endpoints, through
the official openai client against a gateway and a real node (tiny model, fp32, greedy).

- `return_token_ids` (an `extra_body` field): `/v1/completions` choices carry `token_ids` and
  `prompt_token_ids` (streamed: the prompt's in each choice's first chunk); `/v1/chat/completions`
  answers carry `prompt_token_ids` (the chat template's ids) and each choice its `token_ids`
  (streamed: on each chunk, the prompt's on the first).
- A render of a body with a constraint (`response_format`, vLLM's `structured_outputs`) carries
  it in `sampling_params.structured_outputs` as vLLM's render does, and generate from that render
  answers what chat answers for the body: the same tokens, schema-valid JSON.
- `[models.X] closed_objects = false`: that model's guides keep a schema's objects as written
  (the render shows the guide the model is sent), unless the request chooses itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest

from tests.gateway.helpers import MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import TINY_NODE_ARGS, Proc, duet_node, running
from text.tokenizer import Tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
GREEDY: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
IDS = {"extra_body": {"return_token_ids": True}}
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
}


@pytest.fixture(scope="module")
def env(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str, str]]:
    """(gateway url, a team key, the node's url): one colocated node of the tiny model."""
    tmp = tmp_path_factory.mktemp("token-ids")
    node = duet_node("both", str(tiny_llama), tmp, *TINY_NODE_ARGS)
    models = {
        MODEL: tiny_model(tiny_llama, both=[node.url]),
        "tiny-open": tiny_model(tiny_llama, both=[node.url], closed_objects=False),
    }
    gw: Proc = gateway_proc(tmp, models)
    with running(node, gw):
        yield gw.url, make_team(gw.url, "ids"), node.url


def test_completions_carry_their_prompt_and_output_ids(
    env: tuple[str, str, str], tiny_llama: Path
) -> None:
    url, key, _ = env
    tok = Tokenizer(tiny_llama)
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, **IDS)
    extra = whole.choices[0].model_extra or {}
    assert extra["prompt_token_ids"] == tok.encode(PROMPT)
    assert tok.decode(extra["token_ids"]) == whole.choices[0].text
    chunks = [
        c.choices[0].model_extra or {}
        for c in client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **GREEDY, **IDS)
        if c.choices
    ]
    assert chunks[0]["prompt_token_ids"] == tok.encode(PROMPT)
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == extra["token_ids"]
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


def test_chat_carries_its_prompt_and_output_ids(
    env: tuple[str, str, str], tiny_llama: Path
) -> None:
    url, key, _ = env
    tok = Tokenizer(tiny_llama)
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, **GREEDY, **IDS}
    whole = client.chat.completions.create(**kw)
    assert (whole.model_extra or {})["prompt_token_ids"] == tok.encode_chat(MESSAGES)
    out_ids = (whole.choices[0].model_extra or {})["token_ids"]
    assert len(out_ids) == whole.usage.completion_tokens  # type: ignore[union-attr]
    assert tok.decode(out_ids) == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert (chunks[0].model_extra or {})["prompt_token_ids"] == tok.encode_chat(MESSAGES)
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {})["token_ids"]]
    assert streamed == out_ids
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)  # type: ignore[arg-type]
    assert "prompt_token_ids" not in (plain.model_extra or {})


@pytest.mark.parametrize(
    "constraint",
    [
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": SCHEMA},
            }
        },
        {"structured_outputs": {"choice": ["red", "green", "blue"]}},
    ],
)
def test_render_carries_the_constraint_and_generate_obeys_it(
    env: tuple[str, str, str], tiny_llama: Path, constraint: dict[str, Any]
) -> None:
    url, key, _ = env
    tok = Tokenizer(tiny_llama)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    status, _, rendered = http(
        url + "/v1/chat/completions/render", "POST", {**body, **constraint}, key=key
    )
    assert status == 200, rendered
    so = rendered["sampling_params"]["structured_outputs"]
    if "response_format" in constraint:  # the schema as the nodes compile it: objects closed
        assert so == {"json": {**SCHEMA, "additionalProperties": False}}
    else:
        assert so == constraint["structured_outputs"]
    status, _, out = http(url + "/inference/v1/generate", "POST", rendered, key=key)
    assert status == 200, out
    text = tok.decode(out["choices"][0]["token_ids"])
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    chat = client.chat.completions.create(**body, extra_body=constraint)
    assert text == chat.choices[0].message.content
    if "response_format" in constraint:
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert text in constraint["structured_outputs"]["choice"]


async def test_a_nodes_generate_obeys_structured_outputs(
    env: tuple[str, str, str], tiny_llama: Path
) -> None:
    """The node takes the constraint in generate's `sampling_params` too; a form it does not
    serve is a 400 naming the field."""
    _, _, node = env
    ids = Tokenizer(tiny_llama).encode(PROMPT)
    choices = ["yes", "no"]
    sampling = {"max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": choices}}
    async with aiohttp.ClientSession() as s:
        body = {"token_ids": ids, "sampling_params": sampling}
        async with s.post(node + "/inference/v1/generate", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        bad = {**sampling, "structured_outputs": {"grammar": "root ::= 'x'"}}
        async with s.post(
            node + "/inference/v1/generate", json={"token_ids": ids, "sampling_params": bad}
        ) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "sampling_params.structured_outputs", err
    assert Tokenizer(tiny_llama).decode(out["choices"][0]["token_ids"]) in choices


TOOL = {
    "type": "function",
    "function": {"name": "pick", "parameters": SCHEMA},
}


@pytest.mark.parametrize(
    "model, extra, closed",
    [
        (MODEL, {}, True),
        ("tiny-open", {}, False),
        ("tiny-open", {"disable_additional_properties": True}, True),
    ],
)
def test_closed_objects_is_a_per_model_default(
    env: tuple[str, str, str], model: str, extra: dict[str, Any], closed: bool
) -> None:
    """The guide a model is sent for a schema that omits additionalProperties: closed by
    default, as written on a `closed_objects = false` model — for response_format, vLLM's
    structured_outputs (whose own switch wins) and a forced tool's parameters — and the model
    answers under it."""
    url, key, _ = env
    want = {**SCHEMA, "additionalProperties": False} if closed else SCHEMA
    body = {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    forms: list[dict[str, Any]] = [{"structured_outputs": {"json": SCHEMA, **extra}}]
    if not extra:  # the request's own switch is structured_outputs'
        forced = {"type": "function", "function": {"name": "pick"}}
        forms += [{"response_format": fmt}, {"tools": [TOOL], "tool_choice": forced}]
    for form in forms:
        status, _, rendered = http(
            url + "/v1/chat/completions/render", "POST", {**body, **form}, key=key
        )
        assert status == 200, rendered
        assert rendered["sampling_params"]["structured_outputs"]["json"] == want, form
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(**body, response_format=fmt)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
