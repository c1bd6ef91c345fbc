"""The typed OpenAI chat request that `/v1/messages` and `/v1/responses` are translated into.

Both APIs run on the chat path: each builds a `protocol.chat.ChatCompletionRequest` — the very
type a `/v1/chat/completions` body decodes into — and hands it, with its vLLM extras, to the
pipeline as a `TranslatedChat`, which `check_chat` (gateway/serving/chat.py) checks as it checks
any client's; no JSON is written or read back on the way in. Content parts are OpenAI's shape
(`{"type": "text", ...}`, `{"type": "image_url", ...}`), so an image reaches chat's own 400 for
what it cannot serve, in chat's words.

vLLM's request extras (`VllmExtras`: the structured-output fields of
gateway/serving/constraint.py and vLLM's sampling fields top_k, min_p, repetition_penalty,
min_tokens, ignore_eos) are fields of both APIs' request structs (one inherited definition):
`copy_extras` carries the sampling ones onto the chat request, the structured-output ones stay
on the API's request (itself a `VllmFields`), and `check_constraint` first checks the request's
one constraint with the API's own names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.serving.constraint import Names, VllmFields, constraint, refuse_min_tokens
from gateway.serving.requests import RetainMark
from protocol.chat import ChatCompletionRequest, ChatMessage
from protocol.thinking import Thinking
from protocol.tools import NamedToolChoice

#: a content part, in OpenAI's JSON shape (what `ChatMessage.content` holds)
Part = dict[str, Any]


class VllmExtras(VllmFields, kw_only=True):
    """vLLM's request extras as `/v1/messages` and `/v1/responses` take them (clients send them
    in `extra_body`), typed as chat takes them; their ranges are checked by the chat path
    (gateway/serving/chat.py), their constraint by gateway/serving/constraint.py."""

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None


#: the extras' names (an API's request struct inherits them: its accepted fields include these)
EXTRAS = frozenset(VllmExtras.__struct_fields__)
#: the extras that are chat request fields (the rest, the structured-output ones, stay on the
#: API's request, which is a `VllmFields`)
_SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos")


@dataclass(frozen=True)
class TranslatedChat:
    """What a translated API hands the pipeline: the chat request and its vLLM extras."""

    body: ChatCompletionRequest
    vllm: VllmFields
    #: the prompt prefix the client asked to keep cached (Messages' `cache_control`)
    retain: RetainMark | None = None
    #: Messages' extended thinking (None: none asked), for a provider's model that reasons
    thinking: Thinking | None = None


def text_part(text: str) -> Part:
    return {"type": "text", "text": text}


def image_part(url: str) -> Part:
    return {"type": "image_url", "image_url": {"url": url}}


def append(messages: list[ChatMessage], m: ChatMessage) -> None:
    """Add `m`; an assistant turn of tool calls only joins the assistant turn just before it
    (the Responses API gives every call an item of its own; OpenAI wants one assistant message
    holding the text and all its calls)."""
    last = messages[-1] if messages else None
    if (
        last is not None
        and last.role == "assistant"
        and m.role == "assistant"
        and m.tool_calls
        and m.content is None
    ):
        last.tool_calls = [*(last.tool_calls or []), *m.tool_calls]
    else:
        messages.append(m)


def copy_extras(src: VllmExtras, out: ChatCompletionRequest) -> None:
    """vLLM's sampling extras of an API's request onto the chat request (None stays unset)."""
    for name in _SAMPLING_EXTRAS:
        value = getattr(src, name)
        if value is not None:
            setattr(out, name, value)


def check_constraint(body: ChatCompletionRequest, vllm: VllmFields, names: Names) -> None:
    """400 for two constraints on the translated request, or min_tokens with one, naming the
    fields as the client's API does (`names`); the chat path checks the same again, with
    OpenAI's names, and finds nothing."""
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    c = constraint(vllm, body.response_format, forced, names)
    refuse_min_tokens(c.field, body.min_tokens, names)
