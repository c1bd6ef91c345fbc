"""OpenAI chat completions ↔ Anthropic Messages, both ways, as pure functions.

Requests: system/developer messages → `system`; user/assistant turns → `messages` (content
parts: text and images); assistant `tool_calls` → `tool_use` blocks, its `thinking_blocks`
(an earlier answer's reasoning) → `thinking`/`redacted_thinking` blocks first; `tool` messages →
`tool_result` blocks in a user turn; consecutive turns of one role are merged (Anthropic wants
them alternating); `max_tokens` (required by Anthropic) defaults to the provider's
`default_max_tokens`; `stop` → `stop_sequences`; tools and tool_choice are mapped; OpenAI's
temperature range [0, 2] is clamped to Anthropic's [0, 1]. What Anthropic cannot do (n > 1,
logprobs, JSON response formats) is refused with a 400 instead of being silently dropped;
pure sampling hints it lacks (seed, penalties) are dropped.

Errors: Anthropic's error bodies → `ProviderError` (`anthropic_error`). The answers' way back
is translate_answer.py.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from typing import Any

from gateway.backends.providers.anthropic_shapes import (
    TOOL_CHOICES,
    status_of,
)
from gateway.backends.providers.errors import ProviderError, http_error
from gateway.backends.providers.resilience import parse_retry_after
from protocol.openai import read_error

#: OpenAI chat fields that change the sampling only; Anthropic has no equivalent, so dropped
_DROPPED = frozenset(
    {
        "seed",
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "store",
        "metadata",
        "service_tier",
        "stream_options",
        "reasoning_effort",
        "modalities",
        "prediction",
        "top_logprobs",
        "model",
        "messages",
    }
)


def _bad(message: str) -> ProviderError:
    return ProviderError(400, message, kind="invalid_request")


# -- requests -------------------------------------------------------------------------------


def to_anthropic(body: Mapping[str, Any], model: str, default_max_tokens: int) -> dict[str, Any]:
    if body.get("n", 1) not in (1, None):
        raise _bad("n > 1 is not supported by Anthropic models")
    if body.get("logprobs"):
        raise _bad("logprobs are not supported by Anthropic models")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise _bad("response_format other than text is not supported by Anthropic models")
    if body.get("structured_outputs") is not None:
        raise _bad("structured_outputs (vLLM's) is not supported by Anthropic models")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list")

    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object")
        role = m.get("role")
        if role in ("system", "developer"):
            system.append(_text_only(m.get("content"), i))
        elif role == "user":
            _append(turns, "user", _user_blocks(m.get("content"), i))
        elif role == "assistant":
            _append(turns, "assistant", _assistant_blocks(m, i))
        elif role == "tool":
            tid = m.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise _bad(f"messages[{i}].tool_call_id is required for a tool message")
            block = {
                "type": "tool_result",
                "tool_use_id": tid,
                "content": _text_only(m.get("content"), i),
            }
            _append(turns, "user", [block])
        else:
            raise _bad(f"messages[{i}].role {role!r} is not supported")
    if not turns:
        raise _bad("at least one user or assistant message is required")

    out: dict[str, Any] = {"model": model, "messages": turns}
    if system:
        out["system"] = "\n\n".join(system)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None and not (_is_int(mt) and mt >= 1):
        raise _bad("max_tokens must be a positive integer")
    out["max_tokens"] = default_max_tokens if mt is None else mt
    for k, hi in (("temperature", 2.0), ("top_p", 1.0)):
        v = body.get(k)
        if v is not None and not (_is_num(v) and 0 <= v <= hi):
            raise _bad(f"{k} must be a number between 0 and {hi:g}")
    if body.get("temperature") is not None:
        out["temperature"] = min(float(body["temperature"]), 1.0)
    if body.get("top_p") is not None:
        out["top_p"] = body["top_p"]
    if (top_k := body.get("top_k")) is not None:
        if not (_is_int(top_k) and top_k >= 1):
            raise _bad("top_k must be a positive integer")
        out["top_k"] = top_k
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise _bad("stop must be a string or a list of non-empty strings")
        out["stop_sequences"] = stops
    if isinstance(body.get("user"), str):
        out["metadata"] = {"user_id": body["user"]}
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise _bad("tools must be a list")
    if body.get("tools"):
        out["tools"] = [_tool(t, i) for i, t in enumerate(body["tools"])]
    tc = _tool_choice(body.get("tool_choice"), body.get("parallel_tool_calls"))
    if tc is not None:
        out["tool_choice"] = tc
    if isinstance(body.get("thinking"), dict):  # Messages' own field, carried through unchanged
        out["thinking"] = body["thinking"]
    if body.get("stream"):
        out["stream"] = True
    return out


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x


def _append(turns: list[dict[str, Any]], role: str, blocks: list[dict[str, Any]]) -> None:
    if turns and turns[-1]["role"] == role:
        turns[-1]["content"].extend(blocks)
    else:
        turns.append({"role": role, "content": blocks})


def _text_only(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not (
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            ):
                raise _bad(f"messages[{i}].content: only text parts are allowed here")
            parts.append(p["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise _bad(f"messages[{i}].content must be a string or a list of parts")


def _user_blocks(content: Any, i: int) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise _bad(f"messages[{i}].content must be a string or a non-empty list of parts")
    blocks = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            blocks.append({"type": "text", "text": p["text"]})
        elif kind == "image_url":
            blocks.append(_image(p.get("image_url"), i))
        else:
            raise _bad(f"messages[{i}].content: part type {kind!r} is not supported")
    return blocks


def _image(spec: Any, i: int) -> dict[str, Any]:
    url = spec.get("url") if isinstance(spec, dict) else None
    if not isinstance(url, str):
        raise _bad(f"messages[{i}]: image_url.url is required")
    if url.startswith("data:"):
        head, _, data = url.partition(",")
        media = head[5:].removesuffix(";base64")
        if not head.endswith(";base64") or media not in (
            "image/jpeg",
            "image/png",
            "image/gif",
            "image/webp",
        ):
            raise _bad(f"messages[{i}]: images must be base64 jpeg, png, gif or webp data URLs")
        try:
            base64.b64decode(data, validate=True)
        except binascii.Error:
            raise _bad(f"messages[{i}]: the image data is not valid base64") from None
        return {"type": "image", "source": {"type": "base64", "media_type": media, "data": data}}
    if url.startswith("https://"):
        return {"type": "image", "source": {"type": "url", "url": url}}
    raise _bad(f"messages[{i}]: image URLs must be https:// or data: URLs")


#: the fields of a reasoning block the Messages API takes back, by its type
_THOUGHT_FIELDS = {"thinking": ("thinking", "signature"), "redacted_thinking": ("data",)}


def _assistant_blocks(m: dict[str, Any], i: int) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    # the turn's reasoning blocks first, as the model gave them (signed: sent back unchanged)
    for b in m.get("thinking_blocks") or []:
        keep = _THOUGHT_FIELDS.get(str(b.get("type"))) if isinstance(b, dict) else None
        if keep is None:
            raise _bad(f"messages[{i}].thinking_blocks: a block of an unknown type")
        blocks.append({"type": b["type"], **{k: b.get(k) or "" for k in keep}})
    text = _text_only(m.get("content"), i)
    if text:
        blocks.append({"type": "text", "text": text})
    for j, call in enumerate(m.get("tool_calls") or []):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(call.get("id"), str)
        ):
            raise _bad(f"messages[{i}].tool_calls[{j}] needs an id and a function name")
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except (TypeError, ValueError):
            raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON") from None
        if not isinstance(args, dict):
            raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object")
        blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args})
    if not blocks:
        # Anthropic refuses empty turns; an empty assistant message carries no information
        blocks.append({"type": "text", "text": ""})
    return blocks


def _tool(t: Any, i: int) -> dict[str, Any]:
    fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise _bad(f"tools[{i}] must be a function tool with a name")
    out: dict[str, Any] = {
        "name": fn["name"],
        "input_schema": fn.get("parameters") or {"type": "object", "properties": {}},
    }
    if fn.get("description"):
        out["description"] = fn["description"]
    return out


def _tool_choice(tc: Any, parallel: Any) -> dict[str, Any] | None:
    out: dict[str, Any] | None
    if tc is None:
        out = None
    elif isinstance(tc, str) and tc in TOOL_CHOICES:
        out = {"type": TOOL_CHOICES[tc]}
    elif (
        isinstance(tc, dict)
        and isinstance(tc.get("function"), dict)
        and isinstance(tc["function"].get("name"), str)
    ):
        out = {"type": "tool", "name": tc["function"]["name"]}
    else:
        raise _bad("tool_choice must be 'auto', 'none', 'required' or a named function")
    if parallel is False:
        out = {**(out or {"type": "auto"}), "disable_parallel_tool_use": True}
    return out


# -- errors ---------------------------------------------------------------------------------


def error_from(
    etype: Any, message: str, status: int | None, retry_after: float | None = None
) -> ProviderError:
    status = status or status_of(etype)
    return http_error(
        status,
        f"anthropic: {message}",
        retry_after=retry_after,
        error_type=str(etype) if etype else None,
    )


def anthropic_error(status: int, headers: Mapping[str, str], data: bytes) -> ProviderError:
    err = read_error(data)
    msg = (
        (err.message if err is not None else "")
        or data[:200].decode("utf-8", "replace")
        or f"HTTP {status}"
    )
    return error_from(
        err.type if err is not None else None, msg, status, parse_retry_after(headers)
    )
