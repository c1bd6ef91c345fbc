"""The tool-call parsers on recorded model outputs (Qwen2.5's Hermes blocks, Llama 3.1's JSON):
a whole call is a call, anything else — half JSON, an unknown function, arguments that are not
an object — is text, exactly as the model wrote it. Each output is also fed one character at a
time and split at every position: streaming never changes the result."""

from __future__ import annotations

import json

import pytest

from gateway.tools.events import CallArgs, CallStart, Event, Text, ToolParser
from gateway.tools.formats import FORMATS, detect, tool_format
from gateway.tools.hermes import HermesParser
from gateway.tools.llama3_json import Llama3JsonParser

NAMES = ("get_weather", "search")

# (model output, expected: list of ("text", str) | ("call", name, arguments as a dict))
HERMES = [
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
        '"celsius"}}\n</tool_call>',
        [("call", "get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        'Let me check.\n<tool_call>\n{"name": "search", "arguments": {"q": "duet"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        [
            ("text", "Let me check.\n"),
            ("call", "search", {"q": "duet"}),
            ("text", "\n"),
            ("call", "get_weather", {"city": "Oslo"}),
        ],
    ),
    # cut by max_tokens inside the block: text, never half JSON
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [("text", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par')],
    ),
    # the model stopped before the closing tag, the call whole: a call
    (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        [("call", "get_weather", {"city": "Rome"})],
    ),
    # a function nobody offered
    (
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [("text", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>')],
    ),
    # arguments as a JSON string (some fine-tunes write that)
    (
        '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>',
        [("call", "search", {"q": "x"})],
    ),
    ("The weather is fine. <tool", [("text", "The weather is fine. <tool")]),
    ("a < b and <tool_cal is not a tag", [("text", "a < b and <tool_cal is not a tag")]),
    (
        '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',
        [("text", '<tool_call>{"name": "search", "arguments": [1]}</tool_call>')],
    ),
]

LLAMA = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        [("call", "get_weather", {"city": "Paris"})],
    ),
    (
        '<|python_tag|>{"name": "search", "parameters": {"q": "duet"}}',
        [("call", "search", {"q": "duet"})],
    ),
    (
        '{"name": "search", "parameters": {"q": "a"}}; {"name": "get_weather", "parameters": '
        '{"city": "b"}}',
        [("call", "search", {"q": "a"}), ("call", "get_weather", {"city": "b"})],
    ),
    (
        '  {"name": "get_weather", "parameters": {"city": "Pa',
        [("text", '  {"name": "get_weather", "parameters": {"city": "Pa')],
    ),
    ("Paris is sunny today.", [("text", "Paris is sunny today.")]),
    ('{"answer": 42}', [("text", '{"answer": 42}')]),
    (
        '{"name": "search", "parameters": {"q": "a"}}; not json',
        [("text", '{"name": "search", "parameters": {"q": "a"}}; not json')],
    ),
]


def _collapse(events: list[Event]) -> list[tuple[object, ...]]:
    """Events as ("text", all adjacent text) | ("call", name, arguments parsed)."""
    out: list[tuple[object, ...]] = []
    for e in events:
        if isinstance(e, Text):
            if out and out[-1][0] == "text":
                out[-1] = ("text", str(out[-1][1]) + e.text)
            elif e.text:
                out.append(("text", e.text))
        elif isinstance(e, CallStart):
            out.append(("call", e.name, ""))
        else:
            assert isinstance(e, CallArgs) and out and out[-1][0] == "call"
            out[-1] = ("call", out[-1][1], str(out[-1][2]) + e.text)
    return [
        (k, n, json.loads(a)) if k == "call" else (k, n)
        for k, n, *rest in out
        for a in (rest or [None])
    ]


def _run(parser: ToolParser, pieces: list[str]) -> list[tuple[object, ...]]:
    events: list[Event] = []
    for p in pieces:
        events += parser.feed(p)
    return _collapse(events + parser.finish())


@pytest.mark.parametrize(("parser", "cases"), [(HermesParser, HERMES), (Llama3JsonParser, LLAMA)])
def test_recorded_outputs_whole_and_streamed(parser: type, cases: list) -> None:
    for text, want in cases:
        want = [tuple(w) for w in want]
        assert _run(parser(NAMES), [text]) == want, text
        assert _run(parser(NAMES), list(text)) == want, text
        for cut in range(1, len(text)):
            assert _run(parser(NAMES), [text[:cut], text[cut:]]) == want, (text, cut)


def test_text_streams_without_waiting_for_the_end() -> None:
    p = HermesParser(NAMES)
    assert p.feed("Hello, ") == [Text("Hello, ")]
    assert p.feed("world <tool") == [Text("world ")]  # the tail may open a tag: held
    assert p.feed("s>") == [Text("<tools>")]
    q = Llama3JsonParser(NAMES)
    assert q.feed("  ") == [] and q.feed("Sure") == [Text("  Sure")] and q.feed("!") == [Text("!")]


def test_format_from_the_template_or_the_config() -> None:
    assert (
        detect(None).name == "hermes"
    )  # SmolLM2: no tools in its template → the generic prompt, Hermes
    assert (
        detect("{% if tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endif %}").name
        == "hermes"
    )
    assert detect("{{- '<|python_tag|>' }}{% for t in tools %}{% endfor %}").name == "llama3_json"
    assert tool_format("llama3_json", "<tool_call>").name == "llama3_json"
    assert set(FORMATS) == {"hermes", "llama3_json"}
