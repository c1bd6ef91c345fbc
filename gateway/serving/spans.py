"""The request pipeline's spans, one helper per stage, so the pipeline reads as its steps and
not as its tracing (OTel's GenAI semantic conventions, runtime/tracing/names.py). Every helper is a
no-op when tracing is off.

- `Stage`: a span around one step of the pipeline (tokenize, reserve), with `set` for what the
  step found out;
- `settled_attributes`: what the request span says once the usage record is final;
- `client_span`: the GenAI client span, one per call to the model that answers.

`client_span` is what chat, completions (gateway/serving/attempts.py, one per model tried: a
fallback gives two) and embeddings (gateway/serving/embed.py) open around their call: named
`{gen_ai.operation.name} {gen_ai.request.model}`, kind CLIENT, with `error.type` when the call
failed — an APIError's code (else its type), or the exception's class when the client left or a
bug ended it — and, set by the caller's `served()` as the span ends, what was served.

Invariant: usage attributes come only from `served()`, which returns None when nobody served
the call (a model nobody reached served nothing, so its span reports no usage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from gateway.accounts.store.base import UsageRecord
from protocol.openai import APIError
from runtime.tracing import (
    ERROR_TYPE,
    GEN_AI_INPUT_TOKENS,
    GEN_AI_OPERATION,
    GEN_AI_OUTPUT_TOKENS,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    GEN_AI_RESPONSE_MODEL,
    Attrs,
    Tracing,
    inference_span_name,
)


class Stage:
    """A span around one step of the pipeline; `set` adds what the step found (a no-op, like
    the span, when tracing is off). A class, not a generator: it runs twice per request."""

    __slots__ = ("_cm", "_span")

    def __init__(self, tracing: Tracing, name: str, attributes: Attrs | None = None) -> None:
        self._cm = tracing.span(name, attributes)
        self._span: Any = None

    def __enter__(self) -> Stage:
        self._span = self._cm.__enter__()
        return self

    def __exit__(self, *exc: object) -> bool | None:
        return self._cm.__exit__(*exc)

    def set(self, key: str, value: str | int | float) -> None:
        if self._span is not None:
            self._span.set_attribute(key, value)


def settled_attributes(r: UsageRecord) -> Attrs:
    """The request span's attributes from its settled usage record."""
    return {
        GEN_AI_RESPONSE_MODEL: r.model_used,
        GEN_AI_INPUT_TOKENS: r.prompt_tokens,
        GEN_AI_OUTPUT_TOKENS: r.completion_tokens,
        "duet.cached_tokens": r.cached_tokens,
        "duet.status": r.status,
        "duet.cost_usd": r.cost_usd,
        "duet.nodes": list(r.nodes),
        "duet.migrations": r.migrations,
        "duet.ttft_s": r.ttft_s if r.ttft_s is not None else -1.0,
    }


@contextlib.contextmanager
def client_span(
    tracing: Tracing,
    operation: str,
    model: str,
    provider: str,
    attributes: Attrs | None = None,
    served: Callable[[], Attrs | None] = lambda: None,
) -> Iterator[None]:
    """The span around one call to `model`; a no-op when tracing is off."""
    if not tracing.enabled:
        yield
        return
    attrs = {
        GEN_AI_OPERATION: operation,
        GEN_AI_PROVIDER: provider,
        GEN_AI_REQUEST_MODEL: model,
        **(attributes or {}),
    }
    with tracing.span(inference_span_name(operation, model), attrs, kind="CLIENT") as span:
        try:
            yield
        except APIError as e:
            span.set_attribute(ERROR_TYPE, e.code or e.type)
            raise
        except BaseException as e:  # the client left (cancelled), or a bug: its class
            span.set_attribute(ERROR_TYPE, type(e).__name__)
            raise
        finally:
            got = served()
            if got:
                span.set_attributes(got)
