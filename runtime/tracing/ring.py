"""SpanRing: the last N finished spans of a process, kept in memory for the console, and
SpanRecord, one span as the console and the nodes' `GET /spans` carry it.

The ring is an OTel SpanProcessor that keeps the SDK's span objects as they end (nothing is
copied on a request's path) and converts only what a reader asks for.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan

#: spans of one trace one `GET /spans` answer carries at most (a request has about 10 on a
#: node; a trace id that many requests share, from a client's own traceparent, is cut here)
MAX_TRACE_SPANS = 1000


def valid_trace_id(value: str) -> bool:
    """A W3C trace id as the rings name it: 32 lower-case hex digits, not all zero."""
    return len(value) == 32 and all(c in "0123456789abcdef" for c in value) and value != "0" * 32


class SpanRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One finished span as the console reads it (ids in hex, times in unix ns)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    error: bool
    attributes: dict[str, str | int | float | bool | list[str]]
    #: OTel's span kind in lower case: "server" (a request this process answered), "client" (a
    #: call it made: the model call `chat {model}`, `embeddings {model}`), "internal" (a step)
    kind: str = "internal"


def _attr_value(v: object) -> str | int | float | bool | list[str]:
    """An attribute as SpanRecord types it: OTel keeps a sequence as a tuple of str, int, float
    or bool; the record's list is of str (what the console shows, and what the wire between a
    node and the console's decoder validates)."""
    if isinstance(v, (str, int, float, bool)):
        return v
    if isinstance(v, (tuple, list)):
        return [str(i) for i in v]
    return str(v)  # the SDK keeps no other kind (its type says more); a record carries a str


class SpanRing:
    """The last N finished spans of this process, by trace (an OTel SpanProcessor). It keeps
    the SDK's span objects as they end (no copy on the request's path) and converts only what
    a reader asks for."""

    def __init__(self, size: int, service: str) -> None:
        self._spans: deque[ReadableSpan] = deque(maxlen=size)
        self._service = service

    # --- SpanProcessor
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    # --- reading
    def _record(self, span: ReadableSpan) -> SpanRecord:
        ctx, parent = span.context, span.parent
        return SpanRecord(
            trace_id=f"{ctx.trace_id:032x}",
            span_id=f"{ctx.span_id:016x}",
            parent_id=f"{parent.span_id:016x}" if parent is not None else None,
            name=span.name,
            service=self._service,
            start_ns=span.start_time or 0,
            end_ns=span.end_time or 0,
            error=span.status.status_code.name == "ERROR",
            kind=span.kind.name.lower(),
            attributes={k: _attr_value(v) for k, v in (span.attributes or {}).items()},
        )

    def trace(self, trace_id: str, limit: int | None = None) -> list[SpanRecord]:
        """The spans of one trace in start order; `limit`: the first that many (the newest
        spans past it are left out)."""
        tid = int(trace_id, 16)
        got = [self._record(s) for s in list(self._spans) if s.context.trace_id == tid]
        got.sort(key=lambda s: s.start_ns)
        return got if limit is None else got[:limit]

    def roots(self) -> list[SpanRecord]:
        """The spans without a parent in this process, newest first."""
        return [self._record(s) for s in reversed(list(self._spans)) if s.parent is None]

    def requests(self, limit: int = 50) -> list[SpanRecord]:
        """The request spans (those naming a `duet.request_id`), newest first."""
        out = []
        for s in reversed(list(self._spans)):
            if s.attributes and "duet.request_id" in s.attributes:
                out.append(self._record(s))
                if len(out) >= limit:
                    break
        return out

    def values(self, attribute: str) -> set[object]:
        """Every value `attribute` has in the ring, in one pass (a page asking "is this request
        traced?" for 100 rows scanned the whole ring 100 times)."""
        return {
            s.attributes[attribute]
            for s in list(self._spans)
            if s.attributes and attribute in s.attributes
        }

    def find(self, attribute: str, value: object) -> SpanRecord | None:
        s = next(
            (
                s
                for s in reversed(list(self._spans))
                if s.attributes and s.attributes.get(attribute) == value
            ),
            None,
        )
        return self._record(s) if s is not None else None
