"""Bounded numbers in JSON-schema guides: a rewrite of the schema before it is compiled.

llguidance compiles a number with a `minimum` and a `maximum` to a regex whose integer part is
bounded by the bounds' digits but whose fraction is not: `{"type": "number", "minimum": 0,
"maximum": 100}` allows `99.99999…` for ever, and a greedy model that starts repeating a digit
runs into `max_tokens` (`finish_reason: "length"`, JSON that does not parse). `bound_numbers`
gives such a number at most `FRACTION_DIGITS` digits after the point, through the one keyword
llguidance has for it: `multipleOf: 1e-10` (its `MultipleOf` regex refuses a longer fraction,
trailing zeros included). With both bounds the whole literal is then bounded: sign, the bounds'
integer digits, `.`, 10 digits; a bounded number has no exponent (llguidance allows `e` only in
a number with no bounds at all).

What is rewritten: a subschema (at any depth, through the schema keywords below; never inside
`const`, `enum`, `default` or `examples`, which are data) whose `type` is or lists `"number"`,
with at least one numeric bound, and none of `multipleOf` (its own step already bounds the
fraction), `const` or `enum` (finite already). Its bounds must allow the cut, so that no value
the schema requires becomes impossible:
- every bound is finite, at most 1e15 in magnitude (a double's integer digits; larger bounds
  are llguidance's own edge cases) and has at most `FRACTION_DIGITS - 1` fraction digits, so an
  inclusive bound is itself allowed and an exclusive one has a 10-digit value just inside it;
- with two bounds, the range is at least 1e-8 of its larger magnitude (and of 1) wide, so that
  llguidance's floating-point check of a range against `multipleOf` cannot misjudge it;
- with llguidance < 1.8, whose `multipleOf` refuses every negative number (fixed in 1.8.0,
  llguidance#222), only a range with a lower bound >= 0.
A schema that intersects subschemas (`allOf`, `not`, `if`, `dependentSchemas`, or `$ref` /
`anyOf` / `oneOf` beside other constraints) is left as it is: an added `multipleOf` could there
meet a `const` or a narrow range from elsewhere and leave nothing. So is one nested more than
`MAX_DEPTH` (64) subschemas deep.

Not bounded (the schema itself leaves their length open, as a string without `maxLength`): a
number with no bound (JSON's full syntax, exponent included), the integer part of a number or
an integer bounded on one side only, strings, arrays and objects.

Invariants: the rewrite is a pure function of the schema text and the llguidance version, so
the compile caches keyed by the guide's spec stay right, and the gateway's check, a prefill node
and a decode node (which resumes the prefill node's grammar) compile the same grammar; the
client's schema is never modified (a rewritten copy is returned).
"""

from __future__ import annotations

import decimal
import functools
import importlib.metadata
import json
import math
from typing import Any

#: digits allowed after a bounded number's decimal point. 10 is the most llguidance's
#: `multipleOf` can express (it needs the step as an exact u32 multiple of a power of ten,
#: reached by multiplying the f64 by 10: 1e-11 fails as 9999999999999998); a double carries
#: 15-17 significant digits in all, so 10 after the point is already more than most values use.
FRACTION_DIGITS = 10
#: the `multipleOf` that enforces FRACTION_DIGITS (json.dumps writes it as 1e-10)
STEP = 1e-10
#: largest bound magnitude the rewrite touches
MAX_BOUND = 1e15
#: narrowest two-sided range rewritten, relative to max(1, |bound|)
MIN_WIDTH = 1e-8
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: keywords whose value is a map of subschemas, one subschema, or a list of them
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
)
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "items")
#: keywords that intersect schemas wherever they appear
_INTERSECT = ("allOf", "not", "if", "then", "else", "dependentSchemas")
#: keywords that merge with their siblings (llguidance: "the result is intersection")
_MERGING = ("$ref", "anyOf", "oneOf")
#: deepest schema rewritten (nesting of subschemas): `_rewrite` recurses, and a deeper schema is
#: left as it is rather than have its grammar depend on the stack left to the compiling thread
MAX_DEPTH = 64
#: siblings that constrain nothing
_ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "$anchor",
        "$comment",
        "$defs",
        "definitions",
        "title",
        "description",
        "default",
        "examples",
        "deprecated",
        "readOnly",
        "writeOnly",
    }
)


@functools.cache
def signed_multiple_of() -> bool:
    """Whether the installed llguidance's `multipleOf` accepts negative numbers (>= 1.8.0)."""
    try:
        major, minor = (int(p) for p in importlib.metadata.version("llguidance").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return (major, minor) >= (1, 8)


def bound_numbers(schema: Any, signed: bool | None = None) -> Any:
    """`schema` with its bounded numbers' fractions cut to FRACTION_DIGITS digits (a new object;
    `schema` itself if nothing changes). `signed`: whether negative ranges may be rewritten
    (default: what the installed llguidance supports)."""
    if signed is None:
        signed = signed_multiple_of()
    if not isinstance(schema, dict) or not _rewritable(schema):
        return schema
    out, changed = _rewrite(schema, signed)
    return out if changed else schema


def bounded_spec(spec: str) -> str:
    """A JSON-schema guide's spec (compact JSON) as `bound_numbers` rewrites it: for an engine
    that takes the schema's text (vLLM's structured outputs); `spec` itself if nothing changes."""
    schema = json.loads(spec)
    bounded = bound_numbers(schema)
    return (
        spec
        if bounded is schema
        else json.dumps(bounded, separators=(",", ":"), ensure_ascii=False)
    )


def _subschemas(node: dict[str, Any]) -> list[Any]:
    subs: list[Any] = []
    for k in _SCHEMA_MAPS:
        if isinstance(m := node.get(k), dict):
            subs.extend(m.values())
    for k in _SCHEMA_ONE:
        if isinstance(s := node.get(k), dict):
            subs.append(s)
    for k in _SCHEMA_LISTS:
        if isinstance(xs := node.get(k), list):
            subs.extend(xs)
    return subs


def _rewritable(schema: dict[str, Any]) -> bool:
    """False if a subschema of `schema` is intersected with another, or nests deeper than
    MAX_DEPTH (a walk without recursion: a deep schema must not exhaust the stack here)."""
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        if depth > MAX_DEPTH or any(k in node for k in _INTERSECT):
            return False
        if any(k in node for k in _MERGING) and not set(node) <= _ANNOTATIONS.union(_MERGING):
            return False
        stack.extend((s, depth + 1) for s in _subschemas(node))
    return True


def _rewrite(node: Any, signed: bool) -> tuple[Any, bool]:
    """(the node rewritten, whether anything changed); recursive, at most MAX_DEPTH deep."""
    if not isinstance(node, dict):
        return node, False
    out = dict(node)
    changed = False
    for k in _SCHEMA_MAPS:
        if isinstance(m := node.get(k), dict):
            subs = {name: _rewrite(s, signed) for name, s in m.items()}
            if any(c for _, c in subs.values()):
                out[k] = {name: s for name, (s, _) in subs.items()}
                changed = True
    for k in _SCHEMA_ONE:
        if isinstance(s := node.get(k), dict):
            new, c = _rewrite(s, signed)
            if c:
                out[k], changed = new, True
    for k in _SCHEMA_LISTS:
        if isinstance(xs := node.get(k), list):
            news = [_rewrite(s, signed) for s in xs]
            if any(c for _, c in news):
                out[k] = [s for s, _ in news]
                changed = True
    if _cuttable(node, signed):
        out["multipleOf"] = STEP
        changed = True
    return out, changed


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _fraction_digits(v: int | float) -> int:
    if isinstance(v, int):
        return 0
    exp = decimal.Decimal(repr(v)).normalize().as_tuple().exponent
    return max(0, -exp) if isinstance(exp, int) else 0


def _cuttable(node: dict[str, Any], signed: bool) -> bool:
    """Whether `node` is a bounded number whose fraction can be cut without losing a value its
    schema requires (the conditions in the module's docstring)."""
    t = node.get("type")
    if not (t == "number" or (isinstance(t, list) and "number" in t)):
        return False
    if any(k in node for k in ("multipleOf", "const", "enum")):
        return False
    bounds = {k: node[k] for k in _BOUNDS if _is_num(node.get(k))}
    if not bounds:
        return False
    for v in bounds.values():
        if not math.isfinite(v) or abs(v) > MAX_BOUND or _fraction_digits(v) > FRACTION_DIGITS - 1:
            return False
    lows = [bounds[k] for k in ("minimum", "exclusiveMinimum") if k in bounds]
    highs = [bounds[k] for k in ("maximum", "exclusiveMaximum") if k in bounds]
    if lows and highs:
        lo, hi = max(lows), min(highs)
        if hi - lo < MIN_WIDTH * max(1.0, abs(lo), abs(hi)):
            return False
    return signed or (bool(lows) and max(lows) >= 0)
