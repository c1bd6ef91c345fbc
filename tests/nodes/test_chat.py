"""Nodes speak chat too: `POST /v1/chat/completions` and `GET /v1/models` on every
node, so routers written for vLLM workers drive duet nodes unchanged. A chat request in the
two-leg vLLM style (prefill leg with `do_remote_decode`, decode leg with the params it answered)
gives the same greedy text as a colocated node, and the official openai client parses it."""

from __future__ import annotations

import json

import aiohttp
import msgspec
import openai
import pytest

from node.chat import as_completion, parse_chat
from protocol.openai import SamplingFields
from tests.nodes.transfer_checks import PullCheck
from tests.procs import Proc

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours and one animal, please."},
]
GREEDY = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}


async def _chat_stream(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[str, list[dict]]:
    chunks: list[dict] = []
    async with s.post(
        url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"X-Request-Id": body["_rid"]},
    ) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, chunks


async def test_two_leg_chat_equals_colocated(pd_nodes: tuple[Proc, Proc, Proc]) -> None:
    p, d, both = pd_nodes
    check = PullCheck(p, d, "nixl")
    async with aiohttp.ClientSession() as s:
        rid = "chat-two-leg-1"
        body = {"messages": MESSAGES, **GREEDY, "_rid": rid}
        send = {k: v for k, v in body.items() if k != "_rid"}
        # Prefill leg, exactly as vLLM's P/D proxy sends it.
        async with s.post(
            p.url + "/v1/chat/completions",
            headers={"X-Request-Id": rid},
            json={**send, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
        ) as r:
            assert r.status == 200, await r.text()
            pre = await r.json()
        assert pre["object"] == "chat.completion"
        ktp = pre["kv_transfer_params"]
        assert ktp["do_remote_prefill"] and ktp["remote_block_ids"]
        # Decode leg with P's params, streamed.
        pd_text, chunks = await _chat_stream(s, d.url, {**body, "kv_transfer_params": ktp})
        co_text, _ = await _chat_stream(s, both.url, {**body, "_rid": "chat-colocated-1"})
    assert pd_text == co_text and pd_text
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # The decode leg really pulled the prompt's KV over NIXL (not a recompute).
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    assert check.blocks_for(prompt_tokens) >= 1
    assert "KV pull failed" not in d.log()[check.log0 :]


def test_openai_client_against_a_node(pd_nodes: tuple[Proc, Proc, Proc]) -> None:
    _, _, both = pd_nodes
    client = openai.OpenAI(base_url=both.url + "/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] and models.data[0].id
    out = client.chat.completions.create(
        model=models.data[0].id, messages=MESSAGES, max_tokens=8, temperature=0
    )
    assert (
        out.choices[0].message.role == "assistant"
        and out.usage
        and out.usage.completion_tokens >= 1
    )
    stream = client.chat.completions.create(
        model=models.data[0].id, messages=MESSAGES, max_tokens=8, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == out.choices[0].message.content


@pytest.mark.parametrize(
    "body, status",
    [
        ({"messages": []}, 400),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            400,
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "not-this-one"}, 404),
        ({"messages": "hi"}, 400),
    ],
)
async def test_bad_chat_bodies_get_4xx(
    pd_nodes: tuple[Proc, Proc, Proc], body: dict, status: int
) -> None:
    _, _, both = pd_nodes
    async with aiohttp.ClientSession() as s:
        async with s.post(both.url + "/v1/chat/completions", json=body) as r:
            assert r.status == status, await r.text()
            assert (await r.json())["error"]["message"]
        async with s.post(
            both.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}
        ) as r:
            assert r.status == 200


def test_a_chat_request_means_the_completion_with_every_shared_field() -> None:
    """node/chat.py::as_completion carries every field the two forms share (SamplingFields),
    the chat form's own ones mapped: max_completion_tokens → max_tokens, logprobs +
    top_logprobs → logprobs."""
    shared = {
        "model": "m",
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 7,
        "seed": 11,
        "stop": ["x"],
        "stop_token_ids": [3],
        "ignore_eos": True,
        "min_tokens": 2,
        "skip_special_tokens": False,
        "stream": True,
        "stream_options": {"include_usage": False},
        "n": 1,
        "priority": "batch",
        "kv_transfer_params": {"do_remote_decode": True},
        "user": "u-1",
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.25,
        "min_p": 0.05,
        "logit_bias": {"7": -100.0},
    }
    assert set(shared) == set(
        SamplingFields.__struct_fields__
    )  # a new shared field gets a value here
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
        **shared,
    }
    c = as_completion(parse_chat(json.dumps(body).encode()), [1, 2])
    got = {name: getattr(c, name) for name in shared}
    got["stream_options"] = (
        {"include_usage": c.stream_options.include_usage} if c.stream_options else None
    )
    got["kv_transfer_params"] = msgspec.to_builtins(c.kv_transfer_params)  # typed: KVTransferParams
    assert got == shared
    assert (c.prompt, c.max_tokens, c.logprobs) == ([1, 2], 5, 3)
