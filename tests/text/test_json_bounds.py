"""text/json_bounds.py: which numbers of a JSON schema get a bounded fraction, and that the
cut never leaves a schema with nothing to answer (the grammar engine still accepts it)."""

import copy
import json
from pathlib import Path

import pytest

from protocol.structured import Guide, GuideKind
from text.guide_check import canonical_schema, check_guide, guide_grammar
from text.json_bounds import STEP, bound_numbers, bounded_spec

CORPUS = json.loads(
    (Path(__file__).resolve().parents[2] / "bench/data/json_schemas.json").read_text()
)
NUM = {"type": "number", "minimum": 0, "maximum": 100}
CUT = {**NUM, "multipleOf": STEP}


def obj(**props: object) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


def test_the_corpus_bounded_number_is_cut_and_nothing_else() -> None:
    changed = {n for n, s in CORPUS.items() if bound_numbers(s) is not s}
    assert changed == {"bounded_number"}
    assert bound_numbers(CORPUS["bounded_number"])["properties"]["price"] == {
        "maximum": 100,
        "minimum": 0,
        "type": "number",
        "multipleOf": 1e-10,
    }


@pytest.mark.parametrize(
    ("schema", "want"),
    [
        (NUM, CUT),
        (
            {"type": ["number", "null"], "exclusiveMinimum": 0},
            {"type": ["number", "null"], "exclusiveMinimum": 0, "multipleOf": STEP},
        ),
        (
            {"type": "number", "maximum": -1.5},
            {"type": "number", "maximum": -1.5, "multipleOf": STEP},
        ),
        # at every depth, through schema keywords: properties, items, anyOf branches, $defs
        (obj(a={"type": "array", "items": NUM}), obj(a={"type": "array", "items": CUT})),
        ({"anyOf": [NUM, {"type": "string"}]}, {"anyOf": [CUT, {"type": "string"}]}),
        ({"$defs": {"p": NUM}, "$ref": "#/$defs/p"}, {"$defs": {"p": CUT}, "$ref": "#/$defs/p"}),
        (
            {"type": "array", "prefixItems": [NUM], "additionalProperties": NUM},
            {"type": "array", "prefixItems": [CUT], "additionalProperties": CUT},
        ),
    ],
)
def test_bounded_numbers_get_the_step(schema: dict, want: dict) -> None:
    before = copy.deepcopy(schema)
    assert bound_numbers(schema, signed=True) == want
    assert schema == before  # the client's schema is never modified


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number"},  # no bound: JSON's full syntax (exponents) stays
        {"type": "integer", "minimum": 0, "maximum": 9},  # an integer has no fraction
        {**NUM, "multipleOf": 0.5},  # its own step bounds the fraction already
        {**NUM, "const": 3.25},
        {**NUM, "enum": [1.5, 2]},  # finite already
        {
            "type": "number",
            "minimum": 0.000000000001,
        },  # 12 fraction digits: the cut would leave no room
        {"type": "number", "minimum": 0, "maximum": 1e16},  # beyond the magnitudes touched
        {
            "type": "number",
            "minimum": 1,
            "maximum": 1.000000001,
        },  # narrower than 1e-8: llguidance's float check
        {"type": "number", "minimum": 0, "maximum": float("inf")},
        # intersections: an added step could meet a const or a narrow range from elsewhere
        {"allOf": [NUM, {"const": 0.123456789012}]},
        obj(x=NUM) | {"anyOf": [obj(x={"const": 0.123456789012})]},
        {"$defs": {"p": NUM}, "$ref": "#/$defs/p", "maximum": 50},
        {"if": NUM, "then": NUM},
        # data, not schemas
        {"const": NUM},
        {"type": "object", "default": NUM, "examples": [NUM]},
    ],
)
def test_what_is_left_as_it_is(schema: dict) -> None:
    assert bound_numbers(schema, signed=True) is schema


def test_deep_schemas_are_left_as_they_are() -> None:
    deep: dict = NUM
    for _ in range(100):
        deep = {"type": "array", "items": deep}
    assert bound_numbers(deep) is deep
    shallow: dict = NUM
    for _ in range(10):
        shallow = {"type": "array", "items": shallow}
    assert bound_numbers(shallow) is not shallow


def test_old_llguidance_cuts_only_ranges_without_negatives() -> None:
    """llguidance < 1.8's multipleOf refuses every negative number (llguidance#222)."""
    for schema in (
        {"type": "number", "minimum": -1, "maximum": 1},
        {"type": "number", "maximum": 5},
    ):
        assert bound_numbers(schema, signed=False) is schema
    assert bound_numbers(NUM, signed=False) == CUT
    assert (
        bound_numbers({"type": "number", "exclusiveMinimum": 0}, signed=False)["multipleOf"] == STEP
    )


@pytest.mark.parametrize(
    "schema",
    [
        NUM,
        {"type": "number", "minimum": 0.123456789, "exclusiveMaximum": 0.2},
        {"type": "number", "exclusiveMinimum": -0.5, "exclusiveMaximum": 0.5},
        {"type": "number", "minimum": -1e15, "maximum": 1e15},
        {"type": "number", "minimum": 999999999.123456789},
        {"type": "number", "exclusiveMaximum": -999999999.5},
        {"type": "number", "minimum": 1, "maximum": 1.000002},
        {"type": "number", "minimum": 12345.678, "maximum": 12345.679},
    ],
)
def test_a_cut_schema_still_compiles(schema: dict) -> None:
    """Cut ranges keep a value (llguidance refuses a range that holds no multiple of the step)."""
    assert bound_numbers(schema) is not schema
    check_guide(Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema)))


def test_the_grammar_is_the_cut_one_and_the_same_on_every_call() -> None:
    """The gateway's check and both P/D nodes compile through guide_grammar: one grammar per
    spec, the cut schema's (the spec, the cache key, stays the client's schema)."""
    import llguidance

    schema = CORPUS["bounded_number"]
    g = Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema))
    compile_ = lambda s: llguidance.LLMatcher.grammar_from_json_schema(  # noqa: E731
        s, defaults={"whitespace_flexible": False}
    )
    assert "multipleOf" not in g.spec
    assert (
        guide_grammar(g) == guide_grammar(g) == compile_(bound_numbers(schema)) != compile_(schema)
    )


def test_bounded_spec_is_the_spec_unless_cut() -> None:
    """vLLM nodes take the schema as text (node/engines/vllm_sampling.py)."""
    spec = canonical_schema(CORPUS["person"])
    assert bounded_spec(spec) is spec
    cut = json.loads(bounded_spec(canonical_schema(CORPUS["bounded_number"])))
    assert cut == bound_numbers(CORPUS["bounded_number"])
