"""Bad input and bad credentials get the right 4xx, in OpenAI's error body, and the gateway
keeps serving: team isolation, revoked keys, malformed JSON, oversized bodies, unknown models,
over-long prompts, n too large, unsupported fields."""

from __future__ import annotations

import http.client as httpclient
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.gateway.helpers import ADMIN_KEY, MODEL, gateway_proc, http, make_team, tiny_model
from tests.procs import Proc, duet_node, running

MAX_BODY = 64 * 1024


@pytest.fixture(scope="module")
def gw(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Proc, str, str]]:
    tmp = tmp_path_factory.mktemp("gw-errors")
    both = duet_node(
        "both",
        tiny_llama,
        tmp,
        "--dtype",
        "float32",
        "--kv-blocks",
        "256",
        "--max-model-len",
        "1024",
    )
    g = gateway_proc(
        tmp,
        {MODEL: tiny_model(tiny_llama, both=[both.url])},
        server={"max_body_bytes": MAX_BODY, "max_header_bytes": 8192},
    )
    with running(both, g):
        yield g, make_team(g.url, "alpha"), make_team(g.url, "beta")


def chat(**over: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        **over,
    }


def _assert_error(
    status: int,
    body: Any,
    want_status: int,
    want: int,
    code: str | None = None,
    param: str | None = None,
    words: str | None = None,
) -> None:
    assert status == want == want_status, (status, body)
    assert isinstance(body, dict) and set(body["error"]) == {"message", "type", "param", "code"}, (
        body
    )
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    if words is not None:
        assert words in body["error"]["message"], body


CASES = [
    # (name, path, body or raw bytes, status, code, param, words in the message)
    (
        "malformed json",
        "/v1/chat/completions",
        b"{not json",
        400,
        "invalid_json",
        None,
        "malformed",
    ),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, "invalid_json", None, "object"),
    (
        "unknown model",
        "/v1/chat/completions",
        chat(model="gpt-17"),
        404,
        "model_not_found",
        "model",
        "gpt-17",
    ),
    ("n too large", "/v1/chat/completions", chat(n=9), 400, None, "n", "between 1 and 8"),
    ("n zero", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, None, "n", None),
    (
        "two unsupported",
        "/v1/chat/completions",
        chat(audio={"voice": "alloy"}, modalities=["audio"]),
        400,
        "unsupported_field",
        "audio",
        "audio, modalities",
    ),
    # the fields are served, and their values are checked
    (
        "tool_choice names no tool",
        "/v1/chat/completions",
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        400,
        None,
        "tool_choice",
        "'g'",
    ),
    (
        "tool_choice without tools",
        "/v1/chat/completions",
        chat(tool_choice="required"),
        400,
        None,
        "tool_choice",
        None,
    ),
    (
        "parallel_tool_calls without tools",
        "/v1/chat/completions",
        chat(parallel_tool_calls=False),
        400,
        None,
        "parallel_tool_calls",
        None,
    ),
    (
        "bad tool name",
        "/v1/chat/completions",
        chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        400,
        None,
        "tools[0].function.name",
        None,
    ),
    (
        "frequency_penalty",
        "/v1/chat/completions",
        chat(frequency_penalty=2.5),
        400,
        None,
        "frequency_penalty",
        "-2 and 2",
    ),
    (
        "presence_penalty",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "presence_penalty": -3},
        400,
        None,
        "presence_penalty",
        None,
    ),
    (
        "repetition_penalty",
        "/v1/chat/completions",
        chat(repetition_penalty=0),
        400,
        None,
        "repetition_penalty",
        None,
    ),
    ("min_p", "/v1/chat/completions", chat(min_p=1.5), 400, None, "min_p", None),
    (
        "logit_bias value",
        "/v1/chat/completions",
        chat(logit_bias={"5": 101}),
        400,
        None,
        "logit_bias",
        "-100 and 100",
    ),
    (
        "logit_bias key",
        "/v1/chat/completions",
        chat(logit_bias={"hello": 1}),
        400,
        None,
        "logit_bias",
        "'hello'",
    ),
    (
        "logit_bias entries",
        "/v1/chat/completions",
        chat(logit_bias={str(i): 1 for i in range(301)}),
        400,
        None,
        "logit_bias",
        "300",
    ),
    (
        "logit_bias vocabulary",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"99999999": -100}},
        400,
        None,
        "logit_bias",
        "vocabulary",
    ),
    (
        "stop string too long",
        "/v1/chat/completions",
        chat(stop=["x" * 1025]),
        400,
        None,
        "stop",
        "at most 1024 characters",
    ),
    (
        "logit_bias key of 11 digits",
        "/v1/chat/completions",
        chat(logit_bias={"1" * 11: 1}),
        400,
        None,
        "logit_bias",
        "at most 10 digits",
    ),
    (
        "logit_bias key past int()'s digits",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "logit_bias": {"1" * 5000: 1}},
        400,
        None,
        "logit_bias",
        "at most 10 digits",
    ),
    (
        "tool_calls arguments nested past the parser",
        "/v1/chat/completions",
        chat(
            messages=[
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            ]
        ),
        400,
        None,
        "messages",
        "nested too deep",
    ),
    (
        "json_schema without schema",
        "/v1/chat/completions",
        chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        400,
        None,
        "response_format.json_schema",
        None,
    ),
    (
        "min_tokens with a guide",
        "/v1/chat/completions",
        chat(min_tokens=3, response_format={"type": "json_object"}),
        400,
        None,
        "min_tokens",
        None,
    ),
    (
        "response_format type",
        "/v1/chat/completions",
        chat(response_format={"type": "yaml"}),
        400,
        None,
        "response_format",
        None,
    ),
    (
        "top logprobs above 20",
        "/v1/chat/completions",
        chat(logprobs=True, top_logprobs=21),
        400,
        None,
        "top_logprobs",
        "between 0 and 20",
    ),
    (
        "echo",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "echo": True},
        400,
        "unsupported_field",
        "echo",
        None,
    ),
    (
        "image part",
        "/v1/chat/completions",
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x"}}],
                }
            ]
        ),
        400,
        None,
        "messages[0].content",
        "image_url",
    ),
    (
        "tool role without id",
        "/v1/chat/completions",
        chat(messages=[{"role": "tool", "content": "x"}]),
        400,
        None,
        "messages[0].tool_call_id",
        "tool_call_id",
    ),
    (
        "unknown role",
        "/v1/chat/completions",
        chat(messages=[{"role": "robot", "content": "x"}]),
        400,
        None,
        "messages[0].role",
        "robot",
    ),
    ("empty messages", "/v1/chat/completions", chat(messages=[]), 400, None, "messages", None),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, None, "messages", None),
    ("bad type", "/v1/chat/completions", chat(max_tokens="lots"), 400, None, "max_tokens", None),
    ("temperature", "/v1/chat/completions", chat(temperature=3), 400, None, "temperature", None),
    (
        "max_tokens 0",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "max_tokens": 0},
        400,
        None,
        "max_tokens",
        None,
    ),
    (
        "stream_options alone",
        "/v1/chat/completions",
        chat(stream_options={"include_usage": True}),
        400,
        None,
        "stream_options",
        None,
    ),
    (
        "too many stops",
        "/v1/chat/completions",
        chat(stop=["a", "b", "c", "d", "e"]),
        400,
        None,
        "stop",
        None,
    ),
    (
        "bad tier",
        "/v1/chat/completions",
        chat(service_tier="platinum"),
        400,
        None,
        "service_tier",
        None,
    ),
    (
        "user too long",
        "/v1/chat/completions",
        chat(user="u" * 257),
        400,
        None,
        "user",
        "at most 256 characters",
    ),
    (
        "user too long (completions)",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "user": "u" * 257},
        400,
        None,
        "user",
        "at most 256 characters",
    ),
    ("user not a string", "/v1/chat/completions", chat(user=42), 400, None, "user", "str"),
    (
        "user a list (completions)",
        "/v1/completions",
        {"model": MODEL, "prompt": "x", "user": ["a"]},
        400,
        None,
        "user",
        "str",
    ),
    (
        "token out of vocab",
        "/v1/completions",
        {"model": MODEL, "prompt": [1, 2, 10**9]},
        400,
        None,
        "prompt",
        None,
    ),
    (
        "over-long prompt",
        "/v1/completions",
        {"model": MODEL, "prompt": [5] * 1030},
        400,
        "context_length_exceeded",
        None,
        "maximum context length",
    ),
    (
        "prompt + max_tokens too long",
        "/v1/completions",
        {"model": MODEL, "prompt": [5] * 1000, "max_tokens": 100},
        400,
        "context_length_exceeded",
        "max_tokens",
        None,
    ),
    (
        "oversized body",
        "/v1/completions",
        {"model": MODEL, "prompt": "x" * (MAX_BODY + 10)},
        413,
        "request_too_large",
        None,
        "larger",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_requests(gw: tuple[Proc, str, str], case: tuple[Any, ...]) -> None:
    g, key, _ = gw
    _, path, body, status, code, param, words = case
    raw = body if isinstance(body, bytes) else None
    got, headers, resp = http(g.url + path, "POST", None if raw else body, key=key, raw=raw)
    _assert_error(got, resp, status, status, code, param, words)
    assert headers.get("X-Request-Id", "").startswith("req-")


def test_auth_and_team_isolation(gw: tuple[Proc, str, str]) -> None:
    g, alpha, beta = gw
    url = g.url + "/v1/chat/completions"
    s, _, b = http(url, "POST", chat(), key=None)
    _assert_error(s, b, 401, 401, "missing_api_key")
    s, _, b = http(url, "POST", chat(), key="sk-duet-made-up")
    _assert_error(s, b, 401, 401, "invalid_api_key")
    # a team key cannot use admin endpoints, nor read another team's usage
    s, _, b = http(g.url + "/admin/teams", key=alpha)
    _assert_error(s, b, 401, 401, "invalid_api_key")
    s, _, b = http(g.url + "/v1/usage?team_id=beta", key=alpha)
    _assert_error(s, b, 403, 403, "forbidden", "team_id")
    assert http(g.url + "/v1/usage?team_id=alpha", key=alpha)[0] == 200
    assert http(g.url + "/v1/usage?team_id=beta", key=ADMIN_KEY)[0] == 200
    # beta sent nothing: its usage is empty even though alpha's is not
    s, _, b = http(g.url + "/v1/usage", key=beta)
    assert s == 200 and b["team_id"] == "beta" and b["data"][0]["requests"] == 0
    # revoked: create a key, use it, revoke it, it fails; the team's other key still works
    s, _, created = http(g.url + "/admin/keys", "POST", {"team_id": "alpha", "name": "temp"})
    assert s == 201 and "key" in created
    assert http(url, "POST", chat(), key=created["key"])[0] == 200
    listed = http(g.url + "/admin/keys?team_id=alpha")[2]["data"]
    assert all("key" not in k and "secret_hash" not in k for k in listed)  # never shown again
    assert http(g.url + f"/admin/keys/{created['id']}", "DELETE")[0] == 200
    s, _, b = http(url, "POST", chat(), key=created["key"])
    _assert_error(s, b, 401, 401, "invalid_api_key")
    assert http(url, "POST", chat(), key=alpha)[0] == 200
    assert http(g.url + "/v1/usage", key=alpha)[2]["data"][0]["requests"] >= 2
    # duplicate team, unknown team for a key
    s, _, b = http(g.url + "/admin/teams", "POST", {"id": "alpha"})
    _assert_error(s, b, 409, 409)
    s, _, b = http(g.url + "/admin/keys", "POST", {"team_id": "nope"})
    _assert_error(s, b, 404, 404)


def test_openai_client_exceptions_and_still_serving(gw: tuple[Proc, str, str]) -> None:
    g, key, _ = gw
    client = openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}] * 2,
        )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=g.url + "/v1", api_key="sk-duet-nope", max_retries=0).models.list()
    # unknown route and wrong method: OpenAI-shaped too
    s, _, b = http(g.url + "/v1/audio/speech", "POST", {"model": MODEL, "input": "x"}, key=key)
    _assert_error(s, b, 404, 404, "not_found")
    s, _, b = http(g.url + "/v1/embeddings", "POST", {"model": MODEL, "input": "x"}, key=key)
    _assert_error(s, b, 400, 400, "wrong_model_kind", "model")  # a generation model
    s, _, b = http(g.url + "/v1/chat/completions", "GET", key=key)
    _assert_error(s, b, 405, 405)
    # an over-long header is refused by the HTTP parser; the next request is fine
    status, _, _ = _raw_request(g.port, {"X-Big": "x" * 20000})
    assert 400 <= status < 500
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "still here?"}], max_tokens=3
    )
    assert r.choices[0].finish_reason in ("length", "stop")


def _raw_request(port: int, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    conn = httpclient.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health", headers=headers)
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()
