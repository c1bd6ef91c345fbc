"""The optional API features a model serves (`Feature`: the `[models.X] features` key of
gateway.toml), which routing and the request checks read, and each kind of model's default.

Invariant: a self-hosted model serves every feature but `thinking` unless its config lists
fewer; only an Anthropic provider's model can serve `thinking`.
"""

from __future__ import annotations

import enum

from gateway.config_tables import ModelConfig


class Feature(enum.StrEnum):
    """An optional API feature of a request."""

    #: `tools` with a tool_choice other than none, or tool calls/results in the conversation
    TOOLS = "tools"
    #: `response_format` json_object / json_schema
    STRUCTURED_OUTPUTS = "structured_outputs"
    #: vLLM's guided_json, guided_regex, guided_choice, structured_outputs
    #: (gateway/serving/constraint.py)
    VLLM_STRUCTURED_OUTPUTS = "vllm_structured_outputs"
    #: frequency_penalty, presence_penalty, repetition_penalty, min_p
    PENALTIES = "penalties"
    LOGIT_BIAS = "logit_bias"
    #: Anthropic's `thinking` on /v1/messages: only an Anthropic provider's model that lists it
    THINKING = "thinking"


ALL = frozenset(Feature) - {Feature.THINKING}


#: an Anthropic model's default: tools (translated both ways; providers/translate.py)
ANTHROPIC = frozenset({Feature.TOOLS})
#: what an OpenAI-compatible provider serves by default: OpenAI's fields, passed on unchanged
OPENAI_COMPATIBLE = ALL - {Feature.VLLM_STRUCTURED_OUTPUTS}


def model_features(model: ModelConfig) -> frozenset[Feature]:
    """The features `model` serves (its config's `features`, else all for a self-hosted model;
    an external one's default is `ANTHROPIC` or `OPENAI_COMPATIBLE`)."""
    anthropic = model.kind == "external" and model.provider == "anthropic"
    if model.features is None:
        external = ANTHROPIC if anthropic else OPENAI_COMPATIBLE
        return ALL if model.kind != "external" else external
    listed = frozenset(Feature(f) for f in model.features)
    return listed if anthropic else listed - {Feature.THINKING}  # only Anthropic's API thinks


def parse_features(value: object, where: str) -> tuple[str, ...]:
    """A config's `features` list, checked (ValueError names the bad entry)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} features must be a list of: {', '.join(Feature)}")
    bad = [v for v in value if v not in Feature.__members__.values()]
    if bad:
        raise ValueError(
            f"{where} features: unknown {', '.join(map(repr, bad))} (known: {', '.join(Feature)})"
        )
    return tuple(value)
