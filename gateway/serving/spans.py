"""The gateway's GenAI client span: one per call to the model that answers (OTel's GenAI
semantic conventions, runtime/tracing.py).

`client_span` is what chat, completions (gateway/serving/pipeline.py, one per model tried: a fallback
gives two) and embeddings (gateway/api/embeddings.py) open around their call: named
`{gen_ai.operation.name} {gen_ai.request.model}`, kind CLIENT, with `error.type` when the call
failed — an APIError's code (else its type), or the exception's class when the client left or a
bug ended it — and, set by the caller's `served()` as the span ends, what was served.

Invariant: usage attributes come only from `served()`, which returns None when nobody served
the call (a model nobody reached served nothing, so its span reports no usage).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from protocol.openai import APIError
from runtime.tracing import (
    ERROR_TYPE,
    GEN_AI_OPERATION,
    GEN_AI_PROVIDER,
    GEN_AI_REQUEST_MODEL,
    Attrs,
    Tracing,
    inference_span_name,
)


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
