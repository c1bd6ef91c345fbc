"""A guide (protocol/structured.py) in vLLM's `structured_outputs` form and back: what the
token-in/token-out endpoints carry in `sampling_params.structured_outputs`, so a prompt rendered
with a constraint (`response_format`, a forced tool choice, vLLM's extras) is generated under
the same constraint.

`as_structured_outputs(guide)` writes a guide as vLLM's render does: a JSON schema's spec is
already the closed, canonical schema, so it is sent with `disable_additional_properties` unset
(closing a closed schema again changes nothing). `guide_of(so)` reads one back, for the node,
which has no gateway to check the request's fields: exactly one of `json`, `regex`, `choice`,
`json_object`; vLLM's `grammar`, `structural_tag` and `whitespace_pattern` are refused
(ValueError naming the field), never ignored.
"""

from __future__ import annotations

import json

from protocol.structured import Guide, GuideKind, StructuredOutputs
from text.guide_check import choice_guide, json_schema_guide

_KINDS = ("json", "regex", "choice", "json_object")
_REFUSED = ("grammar", "structural_tag", "whitespace_pattern")


def as_structured_outputs(guide: Guide) -> StructuredOutputs:
    """`guide` as vLLM's `structured_outputs` (one field set)."""
    if guide.kind == GuideKind.JSON_SCHEMA:
        return StructuredOutputs(json=json.loads(guide.spec))
    if guide.kind == GuideKind.REGEX:
        return StructuredOutputs(regex=guide.spec)
    if guide.kind == GuideKind.CHOICE:
        return StructuredOutputs(choice=json.loads(guide.spec))
    return StructuredOutputs(json_object=True)


def guide_of(so: StructuredOutputs) -> Guide:
    """The guide `so` asks for; ValueError (its words name the field) for a form not served."""
    for name in _REFUSED:
        if getattr(so, name) is not None:
            raise ValueError(f"structured_outputs.{name} is not supported")
    kinds = [k for k in _KINDS if getattr(so, k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}")
    if so.regex is not None:
        return Guide(kind=GuideKind.REGEX, spec=so.regex)
    if so.choice is not None:
        return choice_guide(so.choice)
    if so.json_object:
        return Guide(kind=GuideKind.JSON_OBJECT)
    schema = json.loads(so.json) if isinstance(so.json, str) else so.json
    return json_schema_guide(schema, closed=so.disable_additional_properties is not False)
