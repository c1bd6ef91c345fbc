"""The names on duet's spans: OTel's GenAI and general attribute names, and the span names the
conventions fix.

Attribute names follow OTel's GenAI semantic conventions where one exists (`GEN_AI_*`); duet's
own are under `duet.`. So do span names where the conventions name one: the gateway's call to
the model that answers (one per model tried: a fallback gives two) is an inference span named
`{gen_ai.operation.name} {gen_ai.request.model}` (`inference_span_name`), kind CLIENT; HTTP
server spans are `{method} {route}` (OTel's HTTP conventions). The steps no convention covers
(auth, route, the P and D legs, KV pull, migration, fallback) are `<process>.<step>`.
"""

from __future__ import annotations

from collections.abc import Mapping

GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_CHOICE_COUNT = "gen_ai.request.choice.count"
#: an embeddings span's: the vector size asked for, and the encodings
GEN_AI_DIMENSIONS = "gen_ai.embeddings.dimension.count"
GEN_AI_ENCODING_FORMATS = "gen_ai.request.encoding_formats"
#: OTel's general attribute for the class of error an operation ended with (low cardinality)
ERROR_TYPE = "error.type"
#: OTel's general attributes for the peer and the HTTP status
SERVER_ADDRESS = "server.address"
HTTP_STATUS = "http.response.status_code"

#: a span's attributes as every span site passes them
Attrs = Mapping[str, "str | int | float | bool | list[str]"]


def inference_span_name(operation: str, model: str) -> str:
    """The GenAI inference span's name: `{gen_ai.operation.name} {gen_ai.request.model}`."""
    return f"{operation} {model}"
