"""text/guide_check.py: response_format → Guide, and the tokenizer-free grammar check."""

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from protocol.openai import APIError
from protocol.structured import Guide, GuideKind, ResponseFormat
from text.guide_check import canonical_schema, check_guide, guide_from_response_format

CORPUS = Path(__file__).resolve().parents[2] / "bench" / "data" / "json_schemas.json"


def rf(body: dict) -> ResponseFormat:
    return msgspec.convert(body, ResponseFormat)


def test_text_is_no_guide_and_json_object_is_one() -> None:
    assert guide_from_response_format(rf({"type": "text"})) is None
    assert guide_from_response_format(None) is None
    assert guide_from_response_format(rf({"type": "json_object"})) == Guide(
        kind=GuideKind.JSON_OBJECT
    )


def test_schema_spec_is_compact_and_keeps_property_order() -> None:
    """Property order is the order the output is generated in: kept, not sorted."""
    g = guide_from_response_format(
        rf(
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "a",
                    "schema": {
                        "type": "object",
                        "properties": {"y": {"type": "integer"}, "x": {"type": "string"}},
                    },
                },
            }
        )
    )
    assert g is not None and g.kind is GuideKind.JSON_SCHEMA
    assert g.spec == (
        '{"type":"object","properties":{"y":{"type":"integer"},"x":{"type":"string"}},'
        '"additionalProperties":false}'  # closed: text/json_closed.py
    )


def test_json_schema_without_schema_is_a_400() -> None:
    for body in ({"type": "json_schema"}, {"type": "json_schema", "json_schema": {"name": "n"}}):
        with pytest.raises(APIError) as e:
            guide_from_response_format(rf(body))
        assert e.value.status == 400 and e.value.param == "response_format"


def test_every_corpus_schema_passes() -> None:
    corpus = json.loads(CORPUS.read_text())
    assert len(corpus) >= 40
    for schema in corpus.values():
        check_guide(Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema)))


@pytest.mark.parametrize(
    ("guide", "words"),
    [
        (Guide(kind=GuideKind.JSON_SCHEMA, spec='{"type": "foo"}'), "Invalid type: foo"),
        (
            Guide(kind=GuideKind.JSON_SCHEMA, spec='{"type": "array", "uniqueItems": true}'),
            "uniqueItems",
        ),
        (
            Guide(
                kind=GuideKind.JSON_SCHEMA, spec='{"type": "integer", "minimum": 5, "maximum": 1}'
            ),
            "minimum (5)",
        ),
        (Guide(kind=GuideKind.JSON_SCHEMA, spec='{"$ref": "#/nope"}'), "/nope"),
        (
            Guide(kind=GuideKind.JSON_SCHEMA, spec='{"type": "string", "pattern": "("}'),
            "unclosed group",
        ),
        (Guide(kind=GuideKind.JSON_SCHEMA, spec="{not json"), "not valid JSON"),
        (Guide(kind=GuideKind.JSON_SCHEMA, spec="[1]"), "object or a boolean"),
        (Guide(kind=GuideKind.REGEX, spec="(ab"), "unclosed group"),
        (Guide(kind=GuideKind.CHOICE, spec="[]"), "the list of choices is empty"),
        (Guide(kind=GuideKind.CHOICE, spec='["a", 1]'), "a list of strings"),
        (Guide(kind=GuideKind.CHOICE, spec='["a", ""]'), "choice 1 is empty"),
        # the bounds (docs/structured-outputs.md): 1,000 choices of 1,000 characters, a
        # 10,000-character regex
        (Guide(kind=GuideKind.CHOICE, spec=json.dumps(["x"] * 1001)), "at most 1000 choices"),
        (
            Guide(kind=GuideKind.CHOICE, spec=json.dumps(["ok", "x" * 1001])),
            "choice 1 is 1001 characters long",
        ),
        (Guide(kind=GuideKind.REGEX, spec="a" * 10_001), "10001 characters long; at most 10000"),
    ],
)
def test_invalid_guides_are_400s_naming_the_fault(guide: Guide, words: str) -> None:
    with pytest.raises(APIError) as e:
        check_guide(guide)
    assert e.value.status == 400 and e.value.param == "response_format"
    assert words in e.value.message


def test_valid_regex_and_choice_pass() -> None:
    check_guide(Guide(kind=GuideKind.REGEX, spec="[0-9]{3}-[a-z]+"))
    check_guide(Guide(kind=GuideKind.CHOICE, spec=json.dumps(["yes", "no", 'say "hi"\n'])))
    check_guide(Guide(kind=GuideKind.JSON_OBJECT))
    check_guide(None)


def test_check_loads_no_torch() -> None:
    """The gateway runs the check: it must not pull torch in (xgrammar would)."""
    code = (
        "import sys\nfrom text.guide_check import check_guide\nfrom protocol.structured import "
        "Guide, GuideKind\n"
        'check_guide(Guide(kind=GuideKind.JSON_SCHEMA, spec=\'{"type":"object"}\'))\n'
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
