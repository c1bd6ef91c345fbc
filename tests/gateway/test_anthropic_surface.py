"""Anthropic's request surface beyond the basics on `/v1/messages` (gateway/api/anthropic/
surface.py), through a real `duet gateway` process and the official `anthropic` client: the
version and beta headers, `thinking`, image blocks, `metadata.user_id` in the usage record.
External models on fake providers only (every refusal comes before any model work)."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.gateway.helpers import http
from tests.gateway.test_anthropic_api import Env, cluster
from tests.gateway.test_providers_e2e import record

ASK: dict[str, Any] = {
    "model": "gpt",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hello there"}],
}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()


@pytest.fixture(scope="module")
def env(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    yield from cluster(tiny_llama, tmp_path_factory, thinking=True)


def _refused(env: Env, says: list[str], **kw: Any) -> None:
    with pytest.raises(anthropic.BadRequestError) as e:
        env.client().messages.create(**{**ASK, **kw})
    assert e.value.status_code == 400 and e.value.body["error"]["type"] == "invalid_request_error"
    for s in says:
        assert s in e.value.message, e.value.message


def test_version_and_beta_headers(env: Env) -> None:
    c = env.client()
    # the SDK sends anthropic-version 2023-06-01 itself; a served beta is taken
    ok = c.messages.create(**ASK, extra_headers={"anthropic-beta": "token-counting-2024-11-01"})
    assert ok.content[0].text == "echo: hello there"
    _refused(
        env,
        ["anthropic-beta", "'files-api-2025-04-14'"],
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31, files-api-2025-04-14"},
    )
    _refused(env, ["anthropic-version", "'latest'"], extra_headers={"anthropic-version": "latest"})


@pytest.mark.parametrize("model", ["gpt", "claude", "tiny"])
def test_thinking_is_refused_naming_the_model_unless_disabled(env: Env, model: str) -> None:
    """An OpenAI-compatible model, an Anthropic one whose features do not list thinking, and a
    self-hosted one: a 400 naming the model; disabled is taken."""
    _refused(
        env,
        ["thinking", repr(model), "disabled"],
        model=model,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    ok = env.client().messages.create(**{**ASK, "model": model}, thinking={"type": "disabled"})
    assert ok.content[0].text


#: the fake provider's reasoning (tests/providers/fakes.py): a signed block and a redacted one
THOUGHT = [
    {"type": "thinking", "thinking": "let me see", "signature": "sig-fake"},
    {"type": "redacted_thinking", "data": "enc-fake"},
]


def test_thinking_passes_to_an_anthropic_model_that_reasons(env: Env) -> None:
    """`claude-thinks` lists the thinking feature: the provider gets the field unchanged, whole
    and streamed, and its answer comes back intact — its thinking block with its signature and
    its redacted_thinking block before the text, whole and streamed (`thinking_delta`s, then
    `signature_delta`), as the official client reads them."""
    kw = {**ASK, "model": "claude-thinks", "max_tokens": 2048}
    thinking = {"type": "enabled", "budget_tokens": 1024}
    c = env.client()
    fake = env.fakes["claude"]
    answer = c.messages.create(**kw, thinking=thinking)  # type: ignore[arg-type]
    assert fake.requests[-1]["thinking"] == thinking
    assert [b.model_dump() for b in answer.content[:2]] == THOUGHT
    assert [b.type for b in answer.content[2:]] == ["text"] and answer.stop_reason == "end_turn"
    assert answer.content[2].text == "echo: hello there"  # type: ignore[union-attr]
    with c.messages.stream(**kw, thinking=thinking) as stream:  # type: ignore[arg-type]
        kinds = [(e.type, getattr(e, "delta", None)) for e in stream]
        final = stream.get_final_message()
    assert fake.requests[-1]["thinking"] == thinking
    assert [b.model_dump() for b in final.content[:2]] == THOUGHT
    assert final.content[2].text == "echo: hello there"  # type: ignore[union-attr]
    deltas = [d.type for k, d in kinds if k == "content_block_delta" and d is not None]
    assert deltas[:3] == ["thinking_delta", "thinking_delta", "signature_delta"], deltas
    _refused(env, ["budget_tokens"], model="claude-thinks", thinking={"type": "enabled"})


def test_thinking_blocks_go_back_to_the_provider(env: Env) -> None:
    """An assistant turn that carries an earlier answer's thinking and redacted_thinking blocks
    (as Anthropic wants them back beside tool results) reaches the provider with them intact,
    before the turn's text; a thinking block in a user turn is a 400."""
    turns = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": [*THOUGHT, {"type": "text", "text": "hi"}]},
        {"role": "user", "content": "hello there"},
    ]
    kw = {"model": "claude-thinks", "max_tokens": 2048, "messages": turns}
    answer = env.client().messages.create(
        **kw,  # type: ignore[arg-type]
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert answer.content[2].text == "echo: hello there"  # type: ignore[union-attr]
    sent = env.fakes["claude"].requests[-1]["messages"][1]
    assert sent == {"role": "assistant", "content": [*THOUGHT, {"type": "text", "text": "hi"}]}
    _refused(
        env,
        ["thinking blocks belong in an assistant turn"],
        messages=[{"role": "user", "content": [THOUGHT[0]]}],
    )


def test_thinking_on_chat_completions_is_reasoning_content(env: Env) -> None:
    """On /v1/chat/completions the same answer's reasoning is vLLM's `reasoning_content` (its
    text) and LiteLLM's `thinking_blocks` (the blocks, signatures and redacted data intact),
    whole and streamed (the stream's pieces join into the same blocks); content stays the
    text. A request without thinking carries neither field."""
    body = {
        "model": "claude-thinks",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 2048,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    status, _, whole = http(env.gw.url + "/v1/chat/completions", "POST", body=body, key=env.key)
    assert status == 200, whole
    m = whole["choices"][0]["message"]
    assert m["content"] == "echo: hello there"
    assert m["reasoning_content"] == "let me see" and m["thinking_blocks"] == THOUGHT
    client = openai.OpenAI(base_url=env.gw.url + "/v1", api_key=env.key, max_retries=0)
    text, reasoning, pieces = "", "", []
    asked = {k: v for k, v in body.items() if k != "thinking"}
    streamed = client.chat.completions.create(
        **asked,  # type: ignore[arg-type]
        stream=True,
        extra_body={"thinking": body["thinking"]},
    )
    for chunk in streamed:
        for c in chunk.choices:
            extra = c.delta.model_extra or {}
            text += c.delta.content or ""
            reasoning += extra.get("reasoning_content") or ""
            pieces += extra.get("thinking_blocks") or []
    assert text == "echo: hello there" and reasoning == "let me see"
    assert [p["type"] for p in pieces] == ["thinking", "thinking", "thinking", "redacted_thinking"]
    assert pieces[2] == {"type": "thinking", "signature": "sig-fake"} and pieces[3] == THOUGHT[1]
    plain = {**body, "model": "claude"}
    del plain["thinking"]
    status, _, answer = http(env.gw.url + "/v1/chat/completions", "POST", body=plain, key=env.key)
    assert status == 200 and "reasoning_content" not in answer["choices"][0]["message"], answer


def test_a_providers_pause_turn_is_a_pause_turn_stop_reason(env: Env) -> None:
    """An Anthropic provider's `pause_turn` comes back as `pause_turn` (not `end_turn`), whole
    and streamed, and as the chat path's finish_reason."""
    kw = {**ASK, "model": "claude", "messages": [{"role": "user", "content": "pause: here"}]}
    c = env.client()
    assert c.messages.create(**kw).stop_reason == "pause_turn"
    with c.messages.stream(**kw) as stream:
        assert stream.get_final_message().stop_reason == "pause_turn"
    status, _, chat = http(env.gw.url + "/v1/chat/completions", "POST", body=kw, key=env.key)
    assert status == 200 and chat["choices"][0]["finish_reason"] == "pause_turn", chat
    # /v1/responses: the turn did not end, so the response is incomplete, its reason Anthropic's
    client = openai.OpenAI(base_url=env.gw.url + "/v1", api_key=env.key, max_retries=0)
    r = client.responses.create(model="claude", input="pause: here")
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "pause_turn"  # type: ignore[comparison-overlap]
    assert [o.status for o in r.output] == ["incomplete"]  # type: ignore[union-attr]
    events = list(client.responses.create(model="claude", input="pause: here", stream=True))
    last = events[-1]
    assert last.type == "response.incomplete", [e.type for e in events]
    assert last.response.incomplete_details.reason == "pause_turn"  # type: ignore[union-attr]


def test_image_blocks_are_refused_where_they_are(env: Env) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    content = [{"type": "text", "text": "what is this?"}, image]
    _refused(
        env,
        ["messages.0.content.1", "image blocks are not supported", "'gpt' takes text only"],
        messages=[{"role": "user", "content": content}],
    )
    turns = [
        {"role": "user", "content": "look"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "see", "input": {}}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [image]}],
        },
    ]
    _refused(env, ["messages.2.content.0.content.0"], messages=turns)
    # count_tokens parses the same body: the same refusal
    status, _, got = http(
        env.gw.url + "/v1/messages/count_tokens",
        "POST",
        body={"model": "gpt", "messages": [{"role": "user", "content": content}]},
        key=None,
        headers={"x-api-key": env.key},
    )
    assert status == 400 and "messages.0.content.1" in got["error"]["message"], got


def test_metadata_user_id_is_the_usage_records_user(env: Env) -> None:
    raw = env.client().messages.with_raw_response.create(**ASK, metadata={"user_id": "user-42"})
    assert raw.parse().content[0].text == "echo: hello there"
    rec = record(env, raw.headers["x-request-id"])  # type: ignore[arg-type]
    assert rec["user"] == "user-42" and rec["status"] == "ok", rec


def test_a_providers_refusal_is_a_refusal_stop_reason(env: Env) -> None:
    """An Anthropic provider's `refusal` crosses the chat path as `content_filter` and comes
    back to a /v1/messages client as `stop_reason: refusal`, whole and streamed."""
    kw = {**ASK, "model": "claude", "messages": [{"role": "user", "content": "refuse: this"}]}
    c = env.client()
    assert c.messages.create(**kw).stop_reason == "refusal"
    with c.messages.stream(**kw) as stream:
        assert stream.get_final_message().stop_reason == "refusal"
    status, _, chat = http(
        env.gw.url + "/v1/chat/completions",
        "POST",
        body={**kw, "messages": kw["messages"]},
        key=env.key,
    )
    assert status == 200 and chat["choices"][0]["finish_reason"] == "content_filter", chat
