"""What a request needs of a model beyond plain text generation, and what a model serves.

`features(request)` names the optional API features a request uses (tools, structured outputs,
vLLM's structured-output extras, penalties, logit_bias); `model_features(config)`
(gateway/config_tables.py, beside the `features` key it reads) those a model serves — by default
every one for a self-hosted model (duet's native engine constrains, penalizes and biases), every one
but vLLM's extras for an OpenAI-compatible provider (it takes OpenAI's fields unchanged;
`guided_json` / `guided_regex` / `guided_choice` / `structured_outputs` are no OpenAI fields, and
OpenAI itself refuses them), or what its `[models.X] features = [...]` lists (a vLLM-engine model, a
provider that cannot, an OpenAI-compatible vLLM server that can). Routing (fallback chains,
`model: "auto"`) skips a model that lacks one of the request's features, and a model named outright
answers 400 naming what it lacks (`refuse_missing`).

Invariant: `features` only reads the checked `Request`; the enum's values are the names the
config file and the error messages use.
"""

from __future__ import annotations

from gateway.config_features import Feature, model_features
from gateway.config_tables import ModelConfig
from gateway.serving.requests import Request
from protocol.openai import APIError


def features(request: Request) -> frozenset[Feature]:
    """The optional features `request` uses."""
    out: set[Feature] = set()
    if request.tools.choice != "none" or request.has_tool_turns:
        out.add(Feature.TOOLS)
    if request.response_format is not None and request.response_format.type != "text":
        out.add(Feature.STRUCTURED_OUTPUTS)
    if request.structured_outputs is not None:
        out.add(Feature.VLLM_STRUCTURED_OUTPUTS)
    s = request.sampling
    if any(getattr(s, n) is not None for n in _PENALTIES):
        out.add(Feature.PENALTIES)
    if s.logit_bias:
        out.add(Feature.LOGIT_BIAS)
    if request.thinking is not None:
        out.add(Feature.THINKING)
    return frozenset(out)


def refuse_missing(request: Request, model: ModelConfig) -> None:
    """400 naming what `model` cannot serve of `request` (before any work is done)."""
    missing = sorted(features(request) - model_features(model))
    if missing:
        raise APIError(
            400,
            f"the model {model.name!r} does not support {', '.join(missing)} "
            f"(its [models.{model.name}] features list what it serves)",
            param=_param(request, missing[0]),
            code="unsupported_feature",
        )


def _param(request: Request, feature: Feature) -> str:
    if feature is Feature.VLLM_STRUCTURED_OUTPUTS and request.constraint_field is not None:
        return request.constraint_field  # the one of vLLM's fields the client sent
    if feature is Feature.PENALTIES:  # the first of them the client sent (min_p, say)
        s = request.sampling
        return next(n for n in _PENALTIES if getattr(s, n) is not None)
    return _PARAM[feature]


_PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty", "min_p")


#: the request field an error about a feature names
_PARAM = {
    Feature.TOOLS: "tools",
    Feature.STRUCTURED_OUTPUTS: "response_format",
    Feature.VLLM_STRUCTURED_OUTPUTS: "structured_outputs",
    Feature.PENALTIES: "frequency_penalty",
    Feature.LOGIT_BIAS: "logit_bias",
    Feature.THINKING: "thinking",
}
