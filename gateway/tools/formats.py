"""The tool-call formats, and which one a model writes: its `[models.X] tool_parser`, else
what its chat template shows (`<tool_call>`: Hermes; `<|python_tag|>` / `"parameters"`:
Llama 3.1 JSON), else Hermes — the format of duet's generic tool prompt, which a template
without tools (SmolLM2's) gets.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
from jinja2.ext import loopcontrols

from gateway.tools import hermes, llama3_json
from gateway.tools.events import ToolParser
from protocol.tools import ToolCall


@dataclass(frozen=True)
class ToolFormat:
    """One model format: its parser, its generic prompt, and how a call is written."""

    name: str
    parser: Callable[[Collection[str]], ToolParser]
    system_prompt: Callable[[Sequence[str]], str]
    call_text: Callable[[Sequence[ToolCall]], str]
    result_text: Callable[[str], str]
    call_schema: Callable[[str, dict[str, Any]], dict[str, Any]]
    #: the key of a call's arguments in this format's JSON
    args_key: str


FORMATS = {
    hermes.NAME: ToolFormat(
        hermes.NAME,
        hermes.HermesParser,
        hermes.system_prompt,
        hermes.call_text,
        hermes.result_text,
        hermes.call_schema,
        hermes.ARGS_KEY,
    ),
    llama3_json.NAME: ToolFormat(
        llama3_json.NAME,
        llama3_json.Llama3JsonParser,
        llama3_json.system_prompt,
        llama3_json.call_text,
        llama3_json.result_text,
        llama3_json.call_schema,
        llama3_json.ARGS_KEY,
    ),
}
TOOL_PARSERS = tuple(FORMATS)


def detect(template: str | None) -> ToolFormat:
    """The format a chat template's tool calls take (Hermes when it shows none)."""
    t = template or ""
    if hermes.OPEN in t:
        return FORMATS[hermes.NAME]
    if llama3_json.PYTHON_TAG in t or '"parameters"' in t:
        return FORMATS[llama3_json.NAME]
    return FORMATS[hermes.NAME]


def tool_format(configured: str | None, template: str | None) -> ToolFormat:
    return FORMATS[configured] if configured is not None else detect(template)


def template_has_tools(template: str | None) -> bool:
    """Whether the chat template renders `tools` itself (HF's `apply_chat_template(tools=…)`):
    it reads the `tools` variable. The word alone is not enough — a template whose text says
    "tools" but never reads the variable would drop the tools the client sent."""
    return template is not None and _reads_tools(template)


@lru_cache(maxsize=64)
def _reads_tools(template: str) -> bool:
    try:
        ast = _PARSER.parse(template)
    except jinja2.TemplateSyntaxError:
        return "tools" in template  # it will not render anyway; keep the plain reading
    return "tools" in jinja2.meta.find_undeclared_variables(ast)


#: parses only (nothing is rendered with it); HF's templates use loop controls
_PARSER = jinja2.Environment(extensions=[loopcontrols])
