"""Bounded numbers have a bounded length on the grammar level (text/json_bounds.py):
the matcher a node compiles (engine/guided.py, the tiny model's byte-level tokenizer, no SmolLM2
needed) takes at most 10 fraction digits in a number with bounds, where llguidance alone takes
them for ever, and still takes every value the schema requires: its bounds, integers, 10-digit
fractions, negative ranges."""

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.guided import GuidedDecoding
from protocol.structured import Guide, GuideKind
from text.guide_check import canonical_schema
from text.json_bounds import FRACTION_DIGITS

CORPUS = json.loads(
    (Path(__file__).resolve().parents[2] / "bench/data/json_schemas.json").read_text()
)
COORDS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["lat"],
    "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
}


@pytest.fixture
def gd(tiny_llama: Path) -> Iterator[GuidedDecoding]:
    g = GuidedDecoding(tiny_llama / "tokenizer.json", 512, frozenset({2}))
    yield g
    g.close()


def matcher(gd: GuidedDecoding, schema: dict, text: str) -> Any:
    """The compiled guide's matcher (llguidance's LLMatcher) after `text` (each token allowed)."""
    m = gd.compile(Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema))).deep_copy()
    for t in gd._llg_tokenizer().tokenize_str(text):
        assert m.consume_token(t), (text, m.get_error())
    return m


def digits_taken(
    gd: GuidedDecoding, schema: dict, head: str, digit: str = "9", most: int = 300
) -> int:
    """How many `digit`s the matcher takes after `head` before it refuses one (up to `most`)."""
    m = matcher(gd, schema, head)
    [tok] = gd._llg_tokenizer().tokenize_str(digit)
    n = 0
    while n < most and m.validate_tokens([tok]) == 1:
        assert m.consume_token(tok)
        n += 1
    return n


def completes(gd: GuidedDecoding, schema: dict, text: str) -> bool:
    m = gd.compile(Guide(kind=GuideKind.JSON_SCHEMA, spec=canonical_schema(schema))).deep_copy()
    return (
        all(m.consume_token(t) for t in gd._llg_tokenizer().tokenize_str(text)) and m.is_accepting()
    )


def test_a_bounded_numbers_fraction_stops_at_ten_digits(gd: GuidedDecoding) -> None:
    """The corpus's "price" in [0, 100]: before, `99.` took 300 nines (any number of them) and a
    greedy answer could run into max_tokens inside it."""
    price = CORPUS["bounded_number"]
    assert digits_taken(gd, price, '{"price":99.') == FRACTION_DIGITS == 10
    assert digits_taken(gd, price, '{"price":0.', "0") == FRACTION_DIGITS  # trailing zeros too
    assert digits_taken(gd, COORDS, '{"lat":-89.') == FRACTION_DIGITS  # and a negative range's
    # after the tenth digit, the number can only end: the answer completes
    m = matcher(gd, price, '{"price":99.' + "9" * FRACTION_DIGITS)
    [close] = gd._llg_tokenizer().tokenize_str("}")
    assert m.validate_tokens([close]) == 1


def test_every_value_the_schema_requires_is_still_allowed(gd: GuidedDecoding) -> None:
    price = CORPUS["bounded_number"]
    for v in ("0", "100", "100.0", "42", "42.5", "0.0000000001", "99.9999999999"):
        assert completes(gd, price, f'{{"price":{v}}}'), v
    for v in ("101", "-1", "100.0000000001", "1e1"):  # the schema's own limits hold as before
        assert not completes(gd, price, f'{{"price":{v}}}'), v
    for v in ("-90", "90", "-0.5", "-89.1234567891", "0"):
        assert completes(gd, COORDS, f'{{"lat":{v}}}'), v
    # a bound with 9 fraction digits is itself a value; an exclusive range keeps its inside
    fine = {"type": "number", "minimum": 0.123456789, "exclusiveMaximum": 0.2}
    assert completes(gd, fine, "0.123456789") and completes(gd, fine, "0.1999999999")
    assert not completes(gd, fine, "0.19999999999") and not completes(gd, fine, "0.2")


def test_unbounded_numbers_keep_jsons_full_syntax(gd: GuidedDecoding) -> None:
    """A number with no bound at all is left as llguidance compiles it (exponents included), and
    so is a bound the cut would not leave room for (12 fraction digits)."""
    assert completes(gd, {"type": "number"}, "6.02e23")
    assert digits_taken(gd, {"type": "number"}, "3.") == 300
    tiny = {"type": "number", "minimum": 0.000000000001, "maximum": 0.000000000002}
    assert completes(gd, tiny, "0.0000000000015")
