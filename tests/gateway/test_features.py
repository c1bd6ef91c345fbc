"""What a request needs (gateway/serving/features.py) and what a model serves: the features a parsed
request uses, the config's `features` and `tool_parser` (checked by name), and the 400 a model
named outright answers for a feature it lacks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.config import ConfigError, parse_config
from gateway.config_features import ALL, Feature, model_features
from gateway.serving.chat import parse_chat
from gateway.serving.features import features, refuse_missing
from gateway.serving.requests import parse_completion
from protocol.openai import APIError

TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


def _chat(**extra: Any) -> bytes:
    return json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    ).encode()


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        ({}, set()),
        ({"tools": [TOOL]}, {Feature.TOOLS}),
        ({"tools": [TOOL], "tool_choice": "none"}, set()),
        ({"response_format": {"type": "json_object"}}, {Feature.STRUCTURED_OUTPUTS}),
        ({"response_format": {"type": "text"}}, set()),
        ({"frequency_penalty": 0.5, "min_p": 0.1}, {Feature.PENALTIES}),
        ({"logit_bias": {"3": -100}}, {Feature.LOGIT_BIAS}),
        ({"guided_choice": ["a", "b"]}, {Feature.VLLM_STRUCTURED_OUTPUTS}),
        (
            {"guided_regex": "[0-9]+", "presence_penalty": 1},
            {Feature.VLLM_STRUCTURED_OUTPUTS, Feature.PENALTIES},
        ),
        ({"structured_outputs": {"json": {"type": "object"}}}, {Feature.VLLM_STRUCTURED_OUTPUTS}),
        ({"guided_json": {"type": "object"}}, {Feature.VLLM_STRUCTURED_OUTPUTS}),
        ({"guided_decoding_backend": "xgrammar"}, set()),  # inert: no constraint, no feature
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
                ]
            },
            {Feature.TOOLS},
        ),
    ],
)
def test_features_of_a_request(extra: dict[str, Any], want: set[Feature]) -> None:
    assert features(parse_chat(_chat(**extra))) == want


def test_completions_carry_structured_outputs_and_penalties() -> None:
    req = parse_completion(
        json.dumps(
            {
                "model": "m",
                "prompt": "x",
                "presence_penalty": 1,
                "response_format": {"type": "json_object"},
            }
        ).encode()
    )
    assert features(req) == {Feature.STRUCTURED_OUTPUTS, Feature.PENALTIES}
    assert req.guide is not None and req.guide.kind == "json_object"


def _model(**extra: Any) -> dict[str, Any]:
    return {"models": {"local": {"kind": "cluster", "tokenizer": "smollm2-135m-instruct", **extra}}}


def test_config_features_and_tool_parser() -> None:
    cfg = parse_config(_model(features=["penalties", "logit_bias"], tool_parser="llama3_json"))
    m = cfg.models["local"]
    assert m.tool_parser == "llama3_json" and model_features(m) == {
        Feature.PENALTIES,
        Feature.LOGIT_BIAS,
    }
    assert model_features(parse_config(_model()).models["local"]) == ALL
    with pytest.raises(APIError) as e:
        refuse_missing(parse_chat(_chat(tools=[TOOL])), m)
    assert (
        e.value.status == 400 and e.value.code == "unsupported_feature" and e.value.param == "tools"
    )
    assert "'local'" in e.value.message and "tools" in e.value.message
    refuse_missing(parse_chat(_chat(logit_bias={"1": 5})), m)  # served: no error
    with pytest.raises(ConfigError, match="'grammar'"):
        parse_config(_model(features=["grammar"]))
    with pytest.raises(ConfigError, match="tool_parser must be one of hermes, llama3_json"):
        parse_config(_model(tool_parser="mistral"))
