"""Fake commercial providers: local aiohttp servers speaking OpenAI chat completions and the
Anthropic Messages API, streaming and not, with failures injected per request.

They exist because the real APIs cannot be reached from tests; test_contract_sdk.py points the
official `openai` and `anthropic` SDKs at them so they stay faithful to the wire formats.

The fake "model" answers `reply(body)` (by default "echo: <last user text>"), one word per
token and per streamed delta; prompt tokens are the words of all messages. `faults` is a queue:
each request takes the next fault, if any:
- `Fault.http(429, retry_after=...)`: an error answer in the provider's own error body;
- `Fault.drop()`: the connection is closed before any answer;
- `Fault.hang()`: no answer until the test ends (first-byte timeouts);
- `Fault.stall_after(n)`: a stream sends n events, then goes silent (idle timeouts);
- `Fault.drop_after(n, cut=None)`: a stream sends n events, then the connection is cut (once
  `cut`, a threading.Event, is set: the events are then known to have reached the client, where a
  reset may otherwise arrive before the gateway read them and the kernel drops them unread);
- `Fault.error_event(n)`: a stream sends n events, then the provider's in-stream error.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

API_KEY = "sk-fake-test-key"


@dataclass(frozen=True)
class Fault:
    kind: str
    status: int = 0
    retry_after: str | None = None
    after: int = 0
    #: drop_after: the cut waits for this (set by the test thread)
    cut: threading.Event | None = None

    @classmethod
    def http(cls, status: int, retry_after: float | str | None = None) -> Fault:
        return cls(
            "status", status=status, retry_after=None if retry_after is None else str(retry_after)
        )

    @classmethod
    def drop(cls) -> Fault:
        return cls("drop")

    @classmethod
    def hang(cls) -> Fault:
        return cls("hang")

    @classmethod
    def hold(cls) -> Fault:
        """Answer as usual, once `released` is set (a slow provider that does answer)."""
        return cls("hold")

    @classmethod
    def stall_after(cls, n: int) -> Fault:
        return cls("stall", after=n)

    @classmethod
    def drop_after(cls, n: int, cut: threading.Event | None = None) -> Fault:
        return cls("drop_after", after=n, cut=cut)

    @classmethod
    def error_event(cls, n: int) -> Fault:
        return cls("error_event", after=n)


def _last_user_text(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            return " ".join(
                p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text"
            )
    return ""


def _words(messages: list[dict[str, Any]], system: str = "") -> int:
    n = len(system.split())
    for m in messages:
        c = m.get("content")
        if isinstance(c, str):
            n += len(c.split())
        elif isinstance(c, list):
            n += sum(
                len(str(p.get("text", p.get("content", ""))).split())
                for p in c
                if isinstance(p, dict)
            )
    return n


@dataclass
class FakeProvider:
    wire: str  # "openai" | "anthropic"
    reply: Callable[[dict[str, Any]], str] = lambda body: (
        "echo: " + _last_user_text(body["messages"])
    )
    #: what the fake bills for a prompt (OpenAI wire): words by default; a test of money
    #: sets a tokenizer's figure (one token per CJK character, several per emoji)
    prompt_tokens: Callable[[list[dict[str, Any]]], int] = _words
    #: what it bills for the rest of the prompt: tool definitions, tool_choice, response_format
    #: (providers render them into the prompt); nothing by default
    request_tokens: Callable[[dict[str, Any]], int] = lambda body: 0
    #: what it reports as read from its prompt cache: on the OpenAI wire within
    #: `prompt_tokens` (`prompt_tokens_details.cached_tokens`), on Anthropic's beside
    #: `input_tokens` (`cache_read_input_tokens`); none by default
    cache_read: int = 0
    #: what it reports as written to that cache (Anthropic's `cache_creation_input_tokens`,
    #: beside `input_tokens`; OpenAI's API has no such figure); none by default
    cache_write: int = 0
    faults: collections.deque[Fault] = field(default_factory=collections.deque)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    #: set by the fixture's teardown so hanging handlers end
    released: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        if self.wire == "openai":
            app.router.add_post("/v1/chat/completions", self._openai)
        else:
            app.router.add_post("/v1/messages", self._anthropic)
        return app

    # -- shared -----------------------------------------------------------------------------

    async def _begin(self, request: web.Request) -> tuple[dict[str, Any] | None, Fault | None]:
        self.headers.append(dict(request.headers))
        try:
            body = await request.json()
        except ValueError:
            body = None
        self.requests.append(body if isinstance(body, dict) else {})
        return body if isinstance(body, dict) else None, (
            self.faults.popleft() if self.faults else None
        )

    async def _pre_answer(
        self, request: web.Request, fault: Fault | None
    ) -> web.StreamResponse | None:
        if fault is None:
            return None
        if fault.kind == "status":
            headers = {"retry-after": fault.retry_after} if fault.retry_after else {}
            return self._error(fault.status, f"injected {fault.status}", headers)
        if fault.kind == "drop":
            assert request.transport is not None
            request.transport.close()
            raise asyncio.CancelledError  # aiohttp ends the handler without writing
        if fault.kind == "hold":
            await self.released.wait()
            return None
        if fault.kind == "hang":
            await self.released.wait()
            return self._error(503, "released")
        return None

    async def _stream(
        self, request: web.Request, events: list[bytes], fault: Fault | None
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"content-type": "text/event-stream", "cache-control": "no-cache"}
        )
        await resp.prepare(request)
        for i, ev in enumerate(events):
            if (
                fault is not None
                and fault.kind in ("stall", "drop_after", "error_event")
                and i == fault.after
            ):
                if fault.kind == "stall":
                    await self.released.wait()
                elif fault.kind == "drop_after":
                    if fault.cut is not None:
                        await asyncio.get_running_loop().run_in_executor(None, fault.cut.wait, 60)
                    assert request.transport is not None
                    request.transport.abort()
                    raise asyncio.CancelledError
                else:
                    await resp.write(self._error_event())
                    await resp.write_eof()
                    return resp
            await resp.write(ev)
        await resp.write_eof()
        return resp

    def _error(
        self, status: int, message: str, headers: dict[str, str] | None = None
    ) -> web.Response:
        if self.wire == "openai":
            kind = {
                400: "invalid_request_error",
                401: "invalid_request_error",
                429: "rate_limit_error",
            }.get(status, "server_error")
            body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        else:
            kind = {
                400: "invalid_request_error",
                401: "authentication_error",
                429: "rate_limit_error",
                529: "overloaded_error",
            }.get(status, "api_error")
            body = {"type": "error", "error": {"type": kind, "message": message}}
        return web.json_response(body, status=status, headers=headers)

    def _error_event(self) -> bytes:
        if self.wire == "openai":
            return (
                b'data: {"error": {"message": "injected stream error", "type": "server_error"}}\n\n'
            )
        return (
            b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
            b'"message": "injected overload"}}\n\n'
        )

    # -- OpenAI chat completions ------------------------------------------------------------

    async def _openai(self, request: web.Request) -> web.StreamResponse:
        body, fault = await self._begin(request)
        if request.headers.get("authorization") != f"Bearer {API_KEY}":
            return self._error(401, "Incorrect API key provided")
        if (
            body is None
            or not isinstance(body.get("messages"), list)
            or not body["messages"]
            or not body.get("model")
        ):
            return self._error(400, "model and messages are required")
        early = await self._pre_answer(request, fault)
        if early is not None:
            return early
        tool = _openai_tool(body)
        if tool is not None:
            return await self._openai_tool(request, body, fault, tool)
        words = self.reply(body).split()
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        finish = "stop"
        if limit is not None and len(words) > limit:
            words, finish = words[:limit], "length"
        text_parts = [w if i == 0 else " " + w for i, w in enumerate(words)]
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time()), body["model"]
        billed = self.prompt_tokens(body["messages"]) + self.request_tokens(body) + self.cache_read
        usage = {
            "prompt_tokens": billed,
            "completion_tokens": len(words),
            "total_tokens": billed + len(words),
            "prompt_tokens_details": {"cached_tokens": self.cache_read},
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {
                                "role": "assistant",
                                "content": "".join(text_parts),
                                "refusal": None,
                            },
                            "logprobs": None,
                            "finish_reason": finish,
                        }
                    ],
                    "usage": usage,
                    "system_fingerprint": "fp_fake",
                }
            )

        deltas = [
            ({"role": "assistant", "content": ""}, None),
            *(({"content": p}, None) for p in text_parts),
            ({}, finish),
        ]
        return await self._stream(request, _openai_events(body, rid, created, deltas, usage), fault)

    async def _openai_tool(
        self, request: web.Request, body: dict[str, Any], fault: Fault | None, tool: str
    ) -> web.StreamResponse:
        """Answers, as the Anthropic fake does, with "Let me check." and a call of `tool`, its
        arguments echoing the last user text (7 completion tokens); a text `raw:<args>` makes
        `<args>` the arguments as they are (a model's arguments that are no JSON object)."""
        rid, created, model = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time()), body["model"]
        said = _last_user_text(body["messages"])
        args = said[4:] if said.startswith("raw:") else json.dumps({"query": said})
        call_id = f"call_{uuid.uuid4().hex[:12]}"
        billed = self.prompt_tokens(body["messages"]) + self.request_tokens(body)
        usage = {
            "prompt_tokens": billed,
            "completion_tokens": 7,
            "total_tokens": billed + 7,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": rid,
                    "object": "chat.completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "logprobs": None,
                            "finish_reason": "tool_calls",
                            "message": {
                                "role": "assistant",
                                "content": "Let me check.",
                                "refusal": None,
                                "tool_calls": [
                                    {
                                        "id": call_id,
                                        "type": "function",
                                        "function": {"name": tool, "arguments": args},
                                    }
                                ],
                            },
                        }
                    ],
                    "usage": usage,
                }
            )

        deltas = [
            ({"role": "assistant", "content": ""}, None),
            ({"content": "Let me check."}, None),
            (
                {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": tool, "arguments": ""},
                        }
                    ]
                },
                None,
            ),
            ({"tool_calls": [{"index": 0, "function": {"arguments": args[:5]}}]}, None),
            ({"tool_calls": [{"index": 0, "function": {"arguments": args[5:]}}]}, None),
            ({}, "tool_calls"),
        ]
        return await self._stream(request, _openai_events(body, rid, created, deltas, usage), fault)

    # -- Anthropic Messages -----------------------------------------------------------------

    async def _anthropic(self, request: web.Request) -> web.StreamResponse:
        body, fault = await self._begin(request)
        # the Messages API takes the key as x-api-key or (as recent SDKs send it) a Bearer token
        if API_KEY not in (
            request.headers.get("x-api-key"),
            request.headers.get("authorization", "").removeprefix("Bearer "),
        ):
            return self._error(401, "invalid x-api-key")
        if not request.headers.get("anthropic-version"):
            return self._error(400, "anthropic-version header is required")
        problem = _anthropic_problem(body)
        if problem:
            return self._error(400, problem)
        assert body is not None
        early = await self._pre_answer(request, fault)
        if early is not None:
            return early
        msg_id, model = f"msg_{uuid.uuid4().hex[:20]}", body["model"]
        prompt = _words(
            body["messages"], body.get("system", "") if isinstance(body.get("system"), str) else ""
        )
        tool = (
            (body.get("tools") or [None])[0]
            if body["messages"][-1]["role"] == "user"
            and (body.get("tool_choice") or {}).get("type") != "none"
            else None
        )
        if tool is not None and not any(
            b.get("type") == "tool_result" for b in _blocks(body["messages"][-1])
        ):
            return await self._anthropic_tool(request, body, fault, msg_id, model, prompt, tool)
        words = self.reply(_as_openai(body)).split()
        # a prompt with "refuse:" in it is refused as Anthropic's classifier does; one with
        # "pause:" pauses the turn as a long server-tool turn does
        stop = (
            "refusal" if "refuse:" in words else "pause_turn" if "pause:" in words else "end_turn"
        )
        if len(words) > body["max_tokens"]:
            words, stop = words[: body["max_tokens"]], "max_tokens"
        parts = [w if i == 0 else " " + w for i, w in enumerate(words)]
        # extended thinking: a thinking block (with its signature) before the text, as the API
        thought = (
            [
                {"type": "thinking", "thinking": "let me see", "signature": "sig-fake"},
                {"type": "redacted_thinking", "data": "enc-fake"},
            ]
            if (body.get("thinking") or {}).get("type") in ("enabled", "adaptive")
            else []
        )
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [*thought, {"type": "text", "text": "".join(parts)}],
                    "stop_reason": stop,
                    "stop_sequence": None,
                    "usage": {**self._cache_counts(prompt), "output_tokens": len(words)},
                }
            )
        events = [
            _sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": msg_id,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {**self._cache_counts(prompt), "output_tokens": 1},
                    },
                },
            ),
            *(_thinking_events(thought) if thought else []),
            _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": len(thought),
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            _sse("ping", {"type": "ping"}),
        ]
        events += [
            _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": len(thought),
                    "delta": {"type": "text_delta", "text": p},
                },
            )
            for p in parts
        ]
        events += [
            _sse("content_block_stop", {"type": "content_block_stop", "index": len(thought)}),
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    # as the API does now: the final input counts again, with the output's
                    "usage": {**self._cache_counts(prompt), "output_tokens": len(words)},
                },
            ),
            _sse("message_stop", {"type": "message_stop"}),
        ]
        return await self._stream(request, events, fault)

    def _cache_counts(self, prompt: int) -> dict[str, int]:
        """Anthropic's input counts: the prompt's words are `input_tokens`, the cache's reads
        and writes come on top (a cached prefix the words do not show)."""
        return {
            "input_tokens": prompt,
            "cache_creation_input_tokens": self.cache_write,
            "cache_read_input_tokens": self.cache_read,
        }

    async def _anthropic_tool(
        self,
        request: web.Request,
        body: dict[str, Any],
        fault: Fault | None,
        msg_id: str,
        model: str,
        prompt: int,
        tool: dict[str, Any],
    ) -> web.StreamResponse:
        """Answers with a text block and a call of the first tool, its input echoing the prompt."""
        tool_input = {"query": _last_user_text(_as_openai(body)["messages"])}
        tu_id = f"toolu_{uuid.uuid4().hex[:12]}"
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": msg_id,
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [
                        {"type": "text", "text": "Let me check."},
                        {
                            "type": "tool_use",
                            "id": tu_id,
                            "name": tool["name"],
                            "input": tool_input,
                        },
                    ],
                    "stop_reason": "tool_use",
                    "stop_sequence": None,
                    "usage": {"input_tokens": prompt, "output_tokens": 7},
                }
            )
        raw = json.dumps(tool_input)
        events = [
            _sse(
                "message_start",
                {
                    "type": "message_start",
                    "message": {
                        "id": msg_id,
                        "type": "message",
                        "role": "assistant",
                        "model": model,
                        "content": [],
                        "stop_reason": None,
                        "stop_sequence": None,
                        "usage": {"input_tokens": prompt, "output_tokens": 1},
                    },
                },
            ),
            _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 0,
                    "content_block": {"type": "text", "text": ""},
                },
            ),
            _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "Let me check."},
                },
            ),
            _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
            _sse(
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": 1,
                    "content_block": {
                        "type": "tool_use",
                        "id": tu_id,
                        "name": tool["name"],
                        "input": {},
                    },
                },
            ),
            _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": raw[:5]},
                },
            ),
            _sse(
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 1,
                    "delta": {"type": "input_json_delta", "partial_json": raw[5:]},
                },
            ),
            _sse("content_block_stop", {"type": "content_block_stop", "index": 1}),
            _sse(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                    "usage": {"output_tokens": 7},
                },
            ),
            _sse("message_stop", {"type": "message_stop"}),
        ]
        return await self._stream(request, events, fault)


def _openai_events(
    body: dict[str, Any],
    rid: str,
    created: int,
    deltas: list[tuple[dict[str, Any], str | None]],
    usage: dict[str, Any],
) -> list[bytes]:
    """An OpenAI chat stream: a chunk per (delta, finish_reason), the usage chunk when asked,
    [DONE]."""
    head = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": body["model"],
    }
    chunks = [
        {**head, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": f}]}
        for d, f in deltas
    ]
    if (body.get("stream_options") or {}).get("include_usage"):
        chunks.append({**head, "choices": [], "usage": usage})
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def _openai_tool(body: dict[str, Any]) -> str | None:
    """The tool a chat request makes the fake call: the named one, else the first; none when
    tool_choice is none or the last turn is not the user's (a tool result is answered in text)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not tools or choice == "none" or body["messages"][-1].get("role") != "user":
        return None
    if isinstance(choice, dict):
        return str(choice["function"]["name"])
    return str(tools[0]["function"]["name"])


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def _blocks(m: dict[str, Any]) -> list[dict[str, Any]]:
    c = m.get("content")
    return [b for b in c if isinstance(b, dict)] if isinstance(c, list) else []


def _as_openai(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic request seen as chat messages (for `reply`)."""
    msgs = []
    for m in body["messages"]:
        c = m["content"]
        text = (
            c
            if isinstance(c, str)
            else " ".join(
                str(b.get("text") or b.get("content") or "") for b in c if isinstance(b, dict)
            )
        )
        msgs.append({"role": m["role"], "content": text})
    return {**body, "messages": msgs}


def _thinking_events(blocks: list[dict[str, Any]]) -> list[bytes]:
    """A thinking block and a redacted one streamed as the API streams them (index 0: its text
    in two pieces, then its signature; index 1: whole in its start)."""
    block, redacted = blocks
    text = block["thinking"]
    deltas = [
        {"type": "thinking_delta", "thinking": text[:3]},
        {"type": "thinking_delta", "thinking": text[3:]},
        {"type": "signature_delta", "signature": block["signature"]},
    ]
    return [
        _sse(
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 0,
                "content_block": {"type": "thinking", "thinking": "", "signature": ""},
            },
        ),
        *(
            _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": d})
            for d in deltas
        ),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse(
            "content_block_start",
            {"type": "content_block_start", "index": 1, "content_block": redacted},
        ),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 1}),
    ]


def _is_thought(b: dict[str, Any]) -> bool:
    """A reasoning block as the API takes it back: signed thinking, or redacted."""
    if b.get("type") == "thinking":
        return isinstance(b.get("thinking"), str) and isinstance(b.get("signature"), str)
    return b.get("type") == "redacted_thinking" and isinstance(b.get("data"), str)


def _anthropic_problem(body: dict[str, Any] | None) -> str | None:
    """The checks the real Messages API makes that a translation bug would trip."""
    if body is None:
        return "body must be a JSON object"
    if not isinstance(body.get("model"), str):
        return "model: Field required"
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] < 1:
        return "max_tokens: Field required"
    if "system" in body and not isinstance(body["system"], str | list):
        return "system: Input should be a valid string"
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "messages: at least one message is required"
    for i, m in enumerate(msgs):
        if m.get("role") not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        if i and msgs[i - 1].get("role") == m.get("role"):
            return f"messages.{i}: roles must alternate between 'user' and 'assistant'"
        c = m.get("content")
        if not isinstance(c, str) and not (
            isinstance(c, list)
            and all(
                isinstance(b, dict)
                and (
                    b.get("type") in ("text", "image", "tool_use", "tool_result")
                    # an earlier answer's reasoning, sent back in its assistant turn
                    or (m.get("role") == "assistant" and _is_thought(b))
                )
                for b in c
            )
        ):
            return f"messages.{i}.content: invalid content"
    if msgs[0].get("role") != "user":
        return "messages: first message must use the user role"
    thinking = body.get("thinking")
    if thinking is not None and thinking.get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or budget < 1024:
            return "thinking.enabled.budget_tokens: Input should be greater than or equal to 1024"
        if budget >= body["max_tokens"]:
            return "`max_tokens` must be greater than `thinking.budget_tokens`"
        if body.get("temperature", 1) != 1:
            return "`temperature` may only be set to 1 when thinking is enabled"
    if "temperature" in body and not 0 <= body["temperature"] <= 1:
        return "temperature: must be between 0 and 1"
    for k in set(body) - {
        "model",
        "max_tokens",
        "messages",
        "system",
        "temperature",
        "top_p",
        "top_k",
        "stop_sequences",
        "stream",
        "metadata",
        "tools",
        "tool_choice",
        "thinking",
    }:
        return f"{k}: Extra inputs are not permitted"
    return None
