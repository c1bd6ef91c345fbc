"""Anthropic's request surface beyond the body's basics: its version and beta headers, the
`thinking` parameter and image blocks — each taken where duet serves it and otherwise refused
with a 400 that says what and why, never ignored.

- `anthropic-version`: a dated version (`YYYY-MM-DD`, from the API's first, 2023-01-01; the
  official clients send theirs, 2023-06-01 or later) is taken: the Messages shapes served here
  are the ones every dated version shares. A value that is no such date is a 400; an absent
  header is taken (curl users).
- `anthropic-beta` (comma-separated): a beta whose feature this gateway serves without asking
  (`BETAS`: token counting, prompt caching's markers and their 1h ttl, streamed tool
  arguments, the larger output and token-efficient tools, which change no shape) is taken; any
  other is a 400 naming it, so a client never believes a feature is on that is not.
- `thinking`: passed to an Anthropic provider's model whose `[models.X] features` list
  `thinking` (the provider reasons; its thinking and redacted_thinking blocks come back
  intact, whole and streamed, and go back to it from an assistant turn); for any other
  model — every self-hosted one — anything but `{"type": "disabled"}` is a 400 naming the
  model (an absent or disabled `thinking` is taken).
- image blocks (in a message or a `tool_result`): no model duet serves takes image input, so an
  image is a 400 naming the model and where the block is (`messages.0.content.1`), in the API's
  own words, before any other work.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from gateway.api.anthropic.wire import ImageBlock, MessagesRequest, ToolResultBlock
from gateway.config_features import Feature, model_features
from gateway.config_tables import ModelConfig
from protocol.openai import APIError

#: a dated `anthropic-version`, and the first one the API has
_VERSION = re.compile(r"\d{4}-\d{2}-\d{2}")
FIRST_VERSION = "2023-01-01"
#: betas whose feature is served here without the header asking for it
BETAS = frozenset(
    {
        "token-counting-2024-11-01",
        "prompt-caching-2024-07-31",
        "extended-cache-ttl-2025-04-11",
        "fine-grained-tool-streaming-2025-05-14",
        "output-128k-2025-02-19",
        "token-efficient-tools-2025-02-19",
    }
)


def check_headers(headers: Mapping[str, str]) -> None:
    """400 for an `anthropic-version` or an `anthropic-beta` this gateway does not serve."""
    version = headers.get("anthropic-version")
    if version is not None and not (
        _VERSION.fullmatch(v := version.strip()) and v >= FIRST_VERSION
    ):
        raise APIError(
            400,
            f"anthropic-version: {version.strip()[:64]!r} is not a version of the API (a date "
            f"YYYY-MM-DD from {FIRST_VERSION} on, such as 2023-06-01)",
        )
    betas = [b.strip() for b in headers.get("anthropic-beta", "").split(",") if b.strip()]
    unknown = [b[:64] for b in betas if b not in BETAS]
    if unknown:
        raise APIError(
            400,
            f"anthropic-beta: unexpected value(s) {', '.join(map(repr, unknown))} (this gateway "
            f"serves the betas {', '.join(sorted(BETAS))}; leave the others out)",
        )


def refuse_thinking(body: MessagesRequest, model: ModelConfig | None) -> None:
    """400 for a `thinking` that asks for reasoning of a model that has none here: any but an
    Anthropic provider's model whose `features` list `thinking` (`model`: the named model's
    config, None when it is not one this gateway serves by name)."""
    if body.thinking is None or not body.thinking.on:
        return
    if model is not None and Feature.THINKING in model_features(model):
        if body.thinking.type == "enabled" and body.thinking.budget_tokens is None:
            raise APIError(400, "thinking.budget_tokens: Field required (with type enabled)")
        return
    raise APIError(
        400,
        f"thinking: model {body.model!r} has no extended thinking on this gateway (only an "
        "Anthropic provider's model whose [models.X] features list thinking reasons here); "
        'leave thinking out or send {"type": "disabled"}',
    )


def refuse_images(body: MessagesRequest) -> None:
    """400 for the first image block, named by its place in the body."""
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            continue
        for j, b in enumerate(m.content):
            where = f"messages.{i}.content.{j}"
            if isinstance(b, ToolResultBlock) and isinstance(b.content, list):
                k = next((k for k, c in enumerate(b.content) if isinstance(c, ImageBlock)), None)
                where = f"{where}.content.{k}"
                found = k is not None
            else:
                found = isinstance(b, ImageBlock)
            if found:
                raise APIError(
                    400,
                    f"{where}: image blocks are not supported: model {body.model!r} takes text "
                    "only (this gateway serves no model with image input)",
                )
