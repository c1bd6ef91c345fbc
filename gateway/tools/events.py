"""What a tool-call parser emits while it reads a model's text, and the one check every
format applies to a call it found.

A parser turns the text of one choice into `Text` (shown to the client as content), or a call:
`CallStart` (its name; the call's id is minted then) followed by `CallArgs` (fragments of the
arguments' JSON). A call is emitted only once it parsed whole (name among the request's
tools, arguments a JSON object), so `auto` never yields half JSON: what does not parse is
`Text`. Only the named-function mode (the output *is* the arguments, enforced by a guide)
streams `CallArgs` as the tokens arrive.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.openai import APIError


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    name: str


@dataclass(frozen=True)
class CallArgs:
    text: str


Event = Text | CallStart | CallArgs


class ToolParser(Protocol):
    """Reads one choice's text incrementally."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]:
        """The text ended (the model stopped or hit max_tokens): flush what is held."""
        ...


def new_call_id() -> str:
    """OpenAI's form: `call_` and 24 characters."""
    return "call_" + secrets.token_hex(12)


def call_events(obj: Any, names: Collection[str], args_key: str) -> list[Event] | None:
    """A decoded call `{"name": ..., <args_key>: {...}}` as events, or None when it is not a
    call of one of `names` with an object of arguments (a JSON text of one is accepted too)."""
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("name"), str)
        or obj["name"] not in names
    ):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return [CallStart(obj["name"]), CallArgs(json.dumps(args, ensure_ascii=False))]


def decode_json(text: str) -> Any:
    """`text` as one JSON value, or None (also for trailing garbage, and for JSON nested past
    the parser's depth: what a model wrote so is no call)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def past_arguments(text: str) -> Any:
    """A past tool call's `arguments` as the client sent them: their JSON value, or None when
    they are not JSON (the prompt shows the string). Nested past the parser's depth they are
    the client's 400, not a RecursionError's 500 and traceback."""
    try:
        return json.loads(text)
    except ValueError:
        return None
    except RecursionError:
        raise APIError(
            400,
            "an assistant message's tool_calls arguments are nested too deep",
            param="messages",
        ) from None
