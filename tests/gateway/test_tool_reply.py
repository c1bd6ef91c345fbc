"""A self-hosted reply with tool calls parsed (gateway/serving/tool_reply.py) and rendered in
OpenAI's shapes (gateway/serving/openai_format.py): pieces of model text in, chat chunks and a whole
body out — the first delta of a call carries index, id, type and name with arguments "", later ones
argument fragments; a choice that called and stopped finishes with `tool_calls`, with content null
in the whole body; a cut call stays text (finish `length`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from gateway.backends.base import Accounting, Piece, Reply
from gateway.serving.openai_format import Formatter
from gateway.serving.tool_reply import with_tool_calls
from gateway.tools.plan import ToolMode, ToolPlan, plan_for
from gateway.tools.spec import check_tools
from protocol.openai import Usage
from protocol.tools import NamedFunction, NamedToolChoice, ToolDef
from text.json_closed import close_objects

TOOLS = [
    msgspec.convert(
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
        ToolDef,
    )
]


def _reply(pieces: list[Piece]) -> Reply:
    async def gen(_: Accounting) -> AsyncIterator[Piece]:
        for p in pieces:
            yield p

    return Reply(gen, prompt_tokens=7)


async def _run(
    plan: ToolPlan, texts: list[str], finish: str = "stop"
) -> tuple[list[dict[str, Any]], Any]:
    pieces = [Piece(index=0, text=t) for t in texts]
    pieces[-1].finish_reason = finish
    reply = with_tool_calls(_reply(pieces), plan)
    assert reply.accounting.prompt_tokens == 7  # the model's tokens, whatever the parser shows
    fmt = Formatter("chat", "req-1", "m", "interactive")
    chunks, got = [], []
    async for p in reply:
        got.append(p)
        chunks.append(json.loads(fmt.chunk(p).decode().removeprefix("data: ")))
    texts_by = {0: [p.text for p in got]}
    calls = {0: [d for p in got for d in p.tool_calls or ()]}
    finishes = {0: next((p.finish_reason for p in got if p.finish_reason), None)}
    body = fmt.body(
        texts_by, finishes, Usage(prompt_tokens=7, completion_tokens=1, total_tokens=8), None, calls
    )
    return chunks, msgspec.to_builtins(body)


def _deltas(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]


async def test_auto_call_in_openai_stream_shape() -> None:
    plan = plan_for(check_tools(TOOLS, "auto", None), None, None)
    out = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    chunks, body = await _run(plan, [out[i : i + 5] for i in range(0, len(out), 5)])
    deltas = _deltas(chunks)
    assert (
        deltas[0]["index"] == 0
        and deltas[0]["type"] == "function"
        and deltas[0]["id"].startswith("call_")
    )
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert all(
        set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas[1:]
    )
    assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Paris"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("content" not in c["choices"][0]["delta"] for c in chunks)  # no text came
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"] == deltas[0]["id"] and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(
        call["function"]["arguments"]
    ) == {"city": "Paris"}


async def test_auto_text_and_cut_call_stay_text() -> None:
    plan = plan_for(check_tools(TOOLS, "auto", None), None, None)
    _, body = await _run(plan, ["Hello ", "there."])
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Hello there.",
        "refusal": None,
        "tool_calls": None,
    }
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    chunks, body = await _run(plan, [cut[:9], cut[9:]], finish="length")
    assert not _deltas(chunks) and body["choices"][0]["finish_reason"] == "length"
    assert (
        body["choices"][0]["message"]["content"] == cut
        and body["choices"][0]["message"]["tool_calls"] is None
    )


async def test_named_function_streams_its_arguments() -> None:
    plan = plan_for(
        check_tools(
            TOOLS,
            NamedToolChoice(type="function", function=NamedFunction(name="get_weather")),
            None,
        ),
        None,
        None,
    )
    assert plan.mode == ToolMode.NAMED and plan.guide is not None
    # the guide: the arguments' schema, its objects closed as strict structured outputs do
    assert json.loads(plan.guide.spec) == close_objects(TOOLS[0].function.parameters)
    chunks, body = await _run(plan, ['{"city', '": "Oslo"}'])
    args = [d["function"]["arguments"] for d in _deltas(chunks)]
    assert args == ["", '{"city', '": "Oslo"}']  # fragments as the tokens came
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(body["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Oslo"
    }


async def test_required_parses_the_calls_json() -> None:
    plan = plan_for(check_tools(TOOLS, "required", None), "llama3_json", None)
    schema = json.loads(plan.guide.spec)  # type: ignore[union-attr]
    assert (
        schema["properties"]["name"] == {"enum": ["get_weather"]}
        and "parameters" in schema["required"]
    )
    _, body = await _run(plan, ['{"name": "get_weather", ', '"parameters": {"city": "Rome"}}'])
    [call] = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(
        call["function"]["arguments"]
    ) == {"city": "Rome"}


async def test_parallel_false_keeps_the_first_call_and_choices_parse_apart() -> None:
    one = plan_for(check_tools(TOOLS, "auto", False), None, None)
    two_calls = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "B"}}</tool_call>'
    )
    _, body = await _run(one, [two_calls])
    assert [
        json.loads(c["function"]["arguments"]) for c in body["choices"][0]["message"]["tool_calls"]
    ] == [{"city": "A"}]
    # n = 2: each choice has its own parser; their pieces interleave
    plan = plan_for(check_tools(TOOLS, "auto", None), None, None)
    half = len(two_calls) // 2
    pieces = [
        Piece(index=0, text=two_calls[:half]),
        Piece(index=1, text="plain "),
        Piece(index=0, text=two_calls[half:], finish_reason="stop"),
        Piece(index=1, text="text", finish_reason="stop"),
    ]
    got = [p async for p in with_tool_calls(_reply(pieces), plan)]
    calls = [d for p in got if p.index == 0 for d in p.tool_calls or ()]
    assert [d.index for d in calls if d.id] == [0, 1]
    assert "".join(p.text for p in got if p.index == 1) == "plain text"
    assert {p.index: p.finish_reason for p in got if p.finish_reason} == {
        0: "tool_calls",
        1: "stop",
    }


async def test_tokens_of_held_text_go_with_the_next_piece_out() -> None:
    """`Piece.tokens`: the tokens of text the parser holds back (a call being written) ride on
    the first piece it emits after them, so a stream that breaks off first does not bill them;
    every token is on exactly one piece out."""
    plan = plan_for(check_tools(TOOLS, "auto", None), None, None)
    out = 'Hi. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    texts = [out[i : i + 3] for i in range(0, len(out), 3)]
    pieces = [Piece(index=0, text=t, tokens=1) for t in texts]
    pieces[-1].finish_reason = "stop"
    got = [p async for p in with_tool_calls(_reply(pieces), plan)]
    assert sum(p.tokens for p in got) == len(pieces)
    assert all(
        p.tokens == 0 for p in got if not p.text and not p.tool_calls and not p.finish_reason
    )
    held = [p.tokens for p in got if p.tokens > 1]  # the call's name waited for its whole header
    assert held, [(p.text, p.tool_calls, p.tokens) for p in got]
