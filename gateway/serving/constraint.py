"""The one constraint a request puts on its whole answer, from whichever field asked for it.

These request fields constrain the answer with a guide (protocol/structured.py): OpenAI's
`response_format` (json_object / json_schema), vLLM's extras `guided_json`, `guided_regex`,
`guided_choice` and `structured_outputs` (`json`, `regex`, `choice` or `json_object`), and a
forced `tool_choice` (`required` or a named function, whose guide gateway/tools/plan.py builds
per model). A JSON schema's objects that list their properties and omit `additionalProperties`
are closed (text/json_closed.py), unless `structured_outputs.disable_additional_properties` is
sent as false. Each constrains the whole answer, so a request may use at most one: two are a 400
naming both. vLLM's older `guided_grammar` and `guided_whitespace_pattern` are refused by name
(a 400 saying what to send instead), never ignored; `guided_decoding_backend` (vLLM's
per-request choice of grammar engine) is taken and changes nothing: duet has one engine.

vLLM's extras become the same `Guide` that `response_format` does, checked by the same grammar
engine call before any node work — the pipeline awaits it (generate.py `admit`) off the event loop,
bounded in time (text/guide_compile.py), since a pathological schema compiles for seconds — so an
invalid regex, an empty or oversized list of choices or a bad schema is a 400 whose `param` names
the field (`guided_choice`, `structured_outputs.regex`, …): `Constraint.param`. They are also kept
in vLLM's newest form (`structured_outputs`, one field set), which is what an OpenAI-compatible
provider serving them is sent (gateway/backends/provider.py); `features.py` counts them as the
feature `vllm_structured_outputs`, which external models lack unless their config lists it.

The same checks serve `/v1/messages` and `/v1/responses`, which take vLLM's extras too (their
request structs inherit `VllmFields` through gateway/api/chat_body.py's VllmExtras): their
translators call `constraint` with the API's own `Names` first (`output_config.format` /
`text.format` rather than `response_format`), so a 400 names the field the client sent; the chat
path then checks the translated request again, and finds it sound.

Invariant: `Constraint.guide` is None or well-formed (its grammar not yet compiled: `param` is
what a refusal names); `field` names the request field it came from (None exactly when there is
no guide and no forced tool choice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import msgspec

from protocol.openai import APIError
from protocol.structured import Guide, GuideKind, ResponseFormat, StructuredOutputs
from text.guide_check import (
    choice_guide,
    guide_from_response_format,
    json_schema_guide,
)

#: vLLM's request fields that constrain the answer (each becomes a guide)
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "structured_outputs")
#: vLLM's older request fields duet does not serve: refused by name (400), never ignored
_REFUSED_FIELDS = {
    "guided_grammar": "duet serves JSON schemas, regular expressions and choices, not grammars: "
    "send guided_json, guided_regex or guided_choice (or structured_outputs with json, regex or "
    "choice); a grammar that is regular can be sent as guided_regex",
    "guided_whitespace_pattern": "duet's JSON output is always compact (no whitespace between "
    "tokens)",
}
#: vLLM's structured-output request fields the gateway takes (on both endpoints): the guided
#: ones, the refused ones (so that their 400 says why) and the inert guided_decoding_backend
VLLM_FIELDS = (*_GUIDED, *_REFUSED_FIELDS, "guided_decoding_backend")
#: structured_outputs fields that choose the constraint: exactly one must be set
_KINDS = ("json", "regex", "choice", "json_object")
#: vLLM's structured_outputs fields duet does not serve (refused when set, never ignored)
_REFUSED = ("grammar", "structural_tag", "whitespace_pattern")
_FORCED_TOOL = "tool_choice"


@dataclass(frozen=True)
class Names:
    """What an API calls the constraints of its own, for the 400s that name them (chat's and the
    completions form's are OpenAI's)."""

    #: its structured-output field (Anthropic's `output_config.format`, Responses' `text.format`)
    response_format: str = "response_format"
    #: a forced tool choice, in the API's words
    forced_tool: str = "a forced tool_choice (required or a named function)"


#: OpenAI's names (chat, completions)
OPENAI = Names()


class VllmFields(msgspec.Struct, kw_only=True):
    """vLLM's extras as the client sent them (None: not sent)."""

    #: a JSON schema, inline or as its JSON text (as structured_outputs.json)
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    #: vLLM's per-request grammar engine ("xgrammar", "guidance", ...): type-checked, then
    #: ignored — duet compiles every guide with llguidance, so no choice is left to make
    guided_decoding_backend: str | None = None


@dataclass(frozen=True)
class Constraint:
    """What constrains a request's answer."""

    #: the guide every leg carries (None: none, or a forced tool choice's, built per model)
    guide: Guide | None = None
    #: the request field the constraint came from ("response_format", "guided_choice",
    #: "structured_outputs", "tool_choice"); None: unconstrained
    field: str | None = None
    #: vLLM's extras normalized to `structured_outputs` with one field set (None: not used)
    structured_outputs: StructuredOutputs | None = None
    #: what an error about `guide` names: the field, or the part of it that holds the guide
    param: str | None = None
    #: `guide` with the schema's objects as written, for a model configured with
    #: `closed_objects = false` — set only where the closing was the default (the request did
    #: not choose: no `disable_additional_properties`) and changed the schema
    open_guide: Guide | None = None


def constraint(
    vllm: VllmFields, rf: ResponseFormat | None, forced_tool: bool, names: Names = OPENAI
) -> Constraint:
    """The request's constraint from vLLM's fields (raw_body.py's `vllm_fields` of the raw body, or
    a request struct that inherits them), its parsed `response_format` and whether its tool_choice
    is forced; 400 for two constraints, or one malformed before any grammar work (the grammar
    engine's check is the pipeline's, async). `names`: how the API calls its own fields."""
    for name, why in _REFUSED_FIELDS.items():
        if getattr(vllm, name) is not None:
            raise APIError(400, f"{name} is not supported: {why}", param=name)
    sources = [
        name
        for name, used in (
            ("response_format", rf is not None and rf.type != "text"),
            *((f, getattr(vllm, f) is not None) for f in _GUIDED),
            (_FORCED_TOOL, forced_tool),
        )
        if used
    ]
    if len(sources) > 1:
        second = names.response_format if sources[1] == "response_format" else sources[1]
        raise APIError(
            400,
            f"{described(sources[0], names)} and {described(sources[1], names)} cannot be "
            "combined: each constrains the whole answer (send one)",
            param=second,
        )
    if not sources:
        return Constraint()
    field = sources[0]
    if field == _FORCED_TOOL:
        return Constraint(field=field)
    if field == "response_format":
        guide = _response_format(rf)
        assert rf is not None
        schema = rf.json_schema.schema if rf.json_schema is not None else None
        return Constraint(
            guide=guide, field=field, param=field, open_guide=_open(guide, schema, None)
        )
    so, param = _normalized(vllm, field)
    guide = _guide(so, param)
    return Constraint(
        guide=guide,
        field=field,
        structured_outputs=so,
        param=param,
        open_guide=_open(guide, so.json, so.disable_additional_properties),
    )


def _open(guide: Guide | None, schema: Any, chosen: bool | None) -> Guide | None:
    """The guide of `schema` with its objects as written, if closing them was the default
    (`chosen`: the request's own `disable_additional_properties`) and changed it."""
    if guide is None or guide.kind != GuideKind.JSON_SCHEMA or schema is None or chosen is not None:
        return None
    opened = json_schema_guide(schema, closed=False)
    return opened if opened.spec != guide.spec else None


def described(source: str, names: Names = OPENAI) -> str:
    """A constraint's source (a `Constraint.field`) as the API's 400s name it."""
    if source == _FORCED_TOOL:
        return names.forced_tool
    return names.response_format if source == "response_format" else source


def refuse_min_tokens(field: str | None, min_tokens: int | None, names: Names = OPENAI) -> None:
    """A finished grammar allows only EOS, which min_tokens forbids: the two cannot meet (400)."""
    if field is not None and min_tokens:
        raise APIError(
            400,
            f"min_tokens cannot be combined with {described(field, names)} (a finished constraint "
            "allows only the end of the answer)",
            param="min_tokens",
        )


def _response_format(rf: ResponseFormat | None) -> Guide | None:
    """The guide response_format asks for (its grammar is checked by the pipeline)."""
    assert rf is not None
    if rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema is None):
        raise APIError(
            400,
            "response_format of type json_schema needs json_schema.schema",
            param="response_format.json_schema",
        )
    return guide_from_response_format(rf)


def _normalized(vllm: VllmFields, field: str) -> tuple[StructuredOutputs, str]:
    """vLLM's field as `structured_outputs` with exactly one constraint set, and the param an
    error about it names."""
    if field == "guided_json":
        return StructuredOutputs(json=_schema(vllm.guided_json, field)), field
    if field == "guided_regex":
        return StructuredOutputs(regex=vllm.guided_regex), field
    if field == "guided_choice":
        return StructuredOutputs(choice=vllm.guided_choice), field
    so = vllm.structured_outputs
    assert so is not None
    for name in _REFUSED:
        if getattr(so, name) not in (None, False):
            raise APIError(
                400,
                f"structured_outputs.{name} is not supported (duet serves json, regex, choice and "
                "json_object)",
                param=f"structured_outputs.{name}",
            )
    kinds = [k for k in _KINDS if getattr(so, k) not in (None, False)]
    if len(kinds) != 1:
        got = f"got {', '.join(kinds)}" if kinds else "got none"
        raise APIError(
            400,
            f"structured_outputs takes exactly one of {', '.join(_KINDS)}; {got}",
            param="structured_outputs",
        )
    kind, param = kinds[0], f"structured_outputs.{kinds[0]}"
    if kind == "json":
        closing = so.disable_additional_properties
        return StructuredOutputs(
            json=_schema(so.json, param), disable_additional_properties=closing
        ), param
    if kind == "json_object":
        return StructuredOutputs(json_object=True), param
    return StructuredOutputs(**{kind: getattr(so, kind)}), param


def _schema(value: Any, param: str) -> dict[str, Any] | bool:
    """structured_outputs.json or guided_json: a schema inline or as its JSON text (vLLM takes
    both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise APIError(400, f"{param} is a string but not JSON: {e}", param=param) from None
    if not isinstance(value, dict | bool):
        raise APIError(400, f"{param} must be a JSON schema (an object)", param=param)
    return value


def _guide(so: StructuredOutputs, param: str) -> Guide:
    if so.regex is not None:
        return Guide(kind=GuideKind.REGEX, spec=so.regex)
    if so.choice is not None:
        try:
            return choice_guide(so.choice)
        except ValueError as e:
            raise APIError(400, f"invalid {param}: {e}", param=param) from None
    if so.json_object:
        return Guide(kind=GuideKind.JSON_OBJECT)
    # objects that omit additionalProperties are closed unless vLLM's switch is sent as false
    return json_schema_guide(so.json, closed=so.disable_additional_properties is not False)
