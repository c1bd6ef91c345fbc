"""text/json_closed.py: which objects of a JSON schema are closed (an omitted
`additionalProperties` read as false), which are left as written, and that the guides the
gateway builds carry the closed schema (so every node compiles it)."""

import copy
import json

import jsonschema
import msgspec
import pytest

from gateway.serving.constraint import VllmFields, constraint
from protocol.openai import APIError
from protocol.structured import ResponseFormat, StructuredOutputs
from text.guide_check import check_guide, guide_from_response_format, json_schema_guide
from text.json_closed import MAX_DEPTH, close_objects

STR = {"type": "string"}


def obj(**props: object) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def closed(schema: dict) -> dict:
    return {**schema, "additionalProperties": False}


@pytest.mark.parametrize(
    ("schema", "want"),
    [
        (obj(city=STR), closed(obj(city=STR))),
        # LangChain's @tool: no "type" beside the properties
        ({"properties": {"a": STR}}, {"properties": {"a": STR}, "additionalProperties": False}),
        (obj(), closed(obj())),
        # at every depth: properties, items, anyOf branches, $defs
        (obj(p=obj(q=STR)), closed(obj(p=closed(obj(q=STR))))),
        (
            {"type": "array", "items": obj(a=STR)},
            {"type": "array", "items": closed(obj(a=STR))},
        ),
        ({"anyOf": [obj(a=STR), STR]}, {"anyOf": [closed(obj(a=STR)), STR]}),
        (
            {"$defs": {"P": obj(a=STR)}, "$ref": "#/$defs/P"},
            {"$defs": {"P": closed(obj(a=STR))}, "$ref": "#/$defs/P"},
        ),
    ],
)
def test_objects_that_list_their_properties_are_closed(schema: dict, want: dict) -> None:
    before = copy.deepcopy(schema)
    assert close_objects(schema) == want
    assert schema == before  # the client's schema is not modified
    check_guide(json_schema_guide(schema))  # the grammar engine takes the closed schema


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object"},  # any object: closing it would allow only {}
        {**obj(a=STR), "additionalProperties": True},
        {**obj(a=STR), "additionalProperties": STR},
        {**obj(a=STR), "patternProperties": {"^x": STR}},
        {**obj(a=STR), "unevaluatedProperties": False},
        # merged with siblings: what they add would become a forbidden key
        {**obj(a=STR), "$ref": "#/$defs/B", "$defs": {"B": {"type": "object"}}},
        {**obj(a=STR), "anyOf": [{"required": ["a"]}, STR]},
        # an intersection's parts are not closed one by one
        {"allOf": [obj(a=STR), obj(b=STR)]},
        {"not": obj(a=STR)},
        STR,
    ],
)
def test_what_is_left_as_written(schema: dict) -> None:
    assert close_objects(schema) == schema


def test_data_keywords_and_deep_schemas_are_not_rewritten() -> None:
    data = {**closed(obj(a=STR)), "default": {"properties": {}}, "examples": [obj()]}
    assert close_objects(data) == data
    deep: dict = STR
    for _ in range(MAX_DEPTH + 5):
        deep = obj(x=deep)
    out = close_objects(deep)
    assert out["additionalProperties"] is False
    node = out
    for _ in range(MAX_DEPTH + 4):
        node = node["properties"]["x"]
    assert "additionalProperties" not in node  # past MAX_DEPTH: as written


def test_a_closed_schema_refuses_an_invented_key() -> None:
    schema = obj(city=STR)
    answer = {"city": "Paris", "country": "France"}
    jsonschema.validate(answer, schema)  # JSON Schema's own default allows it
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(answer, close_objects(schema))


def test_every_request_field_builds_a_closed_guide_unless_vllms_switch_is_false() -> None:
    schema = obj(city=STR)
    want = json.dumps(closed(schema), separators=(",", ":"))
    body = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    guide = guide_from_response_format(msgspec.convert(body, ResponseFormat))
    assert guide is not None and guide.spec == want
    for vllm in (
        VllmFields(guided_json=schema),
        VllmFields(structured_outputs=StructuredOutputs(json=schema)),
        VllmFields(
            structured_outputs=StructuredOutputs(json=schema, disable_additional_properties=True)
        ),
    ):
        c = constraint(vllm, None, False)
        assert c.guide is not None and c.guide.spec == want
    c = constraint(
        VllmFields(
            structured_outputs=StructuredOutputs(json=schema, disable_additional_properties=False)
        ),
        None,
        False,
    )
    assert c.guide is not None and json.loads(c.guide.spec) == schema
    # the provider's copy keeps the client's switch and schema
    assert c.structured_outputs is not None and c.structured_outputs.json == schema
    assert c.structured_outputs.disable_additional_properties is False
    with pytest.raises(APIError) as e:  # still refused where it means nothing
        constraint(
            VllmFields(structured_outputs=StructuredOutputs(grammar="root ::= x")), None, False
        )
    assert e.value.status == 400
