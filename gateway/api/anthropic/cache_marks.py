"""A Messages request's `cache_control` breakpoints as the prefix the gateway asks the nodes to
keep (gateway/serving/retain.py `RetainMark`).

Anthropic's prompt order is tools, system, messages; a breakpoint on a tool, a system block or a
message's content block marks the end of a prefix to cache. The nodes keep one prefix per
request: the one ending at the last breakpoint, for the longest ttl asked (Anthropic requires
the 1h breakpoints to come before the 5m ones, so the longer ttl covers the shorter prefix and a
single retention covers both). Like Anthropic, at most `MAX_BREAKPOINTS` may be given.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.api.anthropic.wire import Cacheable, MessagesRequest
from gateway.serving.requests import RetainMark
from protocol.openai import APIError
from protocol.retention import RetainTTL

MAX_BREAKPOINTS = 4


def _marked(blocks: Sequence[object]) -> list[RetainTTL]:
    return [
        b.cache_control.ttl
        for b in blocks
        if isinstance(b, Cacheable) and b.cache_control is not None
    ]


def retain_mark(body: MessagesRequest, system_end: int, turn_ends: list[int]) -> RetainMark | None:
    """The prefix to keep: `system_end` is the number of chat messages the system prompt
    became, `turn_ends[i]` the number after message i (tools alone: 0 messages)."""
    marks: list[tuple[int, RetainTTL]] = [(0, t) for t in _marked(body.tools or [])]
    if isinstance(body.system, list):
        marks += [(system_end, t) for t in _marked(body.system)]
    for m, end in zip(body.messages, turn_ends, strict=True):
        if not isinstance(m.content, str):
            marks += [(end, t) for t in _marked(m.content)]
    if not marks:
        return None
    if len(marks) > MAX_BREAKPOINTS:
        raise APIError(
            400,
            f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. "
            f"Found {len(marks)}.",
        )
    ttl = max((t for _, t in marks), key=lambda t: t.seconds)
    return RetainMark(messages=max(n for n, _ in marks), ttl=ttl)
