"""Closed objects in JSON-schema guides: what an object schema that omits `additionalProperties`
allows.

JSON Schema's own default is open: `{"type": "object", "properties": {"city": ...}}` also
allows any other key. Compiled literally, a small model under the guide keeps inventing keys
after the declared ones until `max_tokens` cuts the answer into JSON that does not parse — and
schemas that omit the keyword are the common case (LangChain's `@tool`, Pydantic's
`model_json_schema()`, most hand-written tool parameters). The engines clients compare duet to
read it otherwise: xgrammar (vLLM's default grammar engine) compiles in strict mode, where an
absent `additionalProperties` is false, and OpenAI's strict structured outputs require it to be
false. duet therefore closes objects by default: `close_objects` gives every object subschema
that lists its `properties` and says nothing of other keys `additionalProperties: false`.

What is closed: a subschema (at any depth, through the schema keywords below; never inside
`const`, `enum`, `default` or `examples`, which are data) with a `properties` object and none of
`additionalProperties`, `patternProperties` or `unevaluatedProperties` (the schema chose). Left
as written:
- an object with no `properties` (`{"type": "object"}` means "any object": closing it would
  allow only `{}`);
- a subschema that merges with siblings (`$ref`, `anyOf`, `oneOf` beside its `properties`):
  the properties a branch or reference adds would become forbidden keys;
- anything under a keyword that intersects schemas (`allOf`, `not`, `if`/`then`/`else`,
  `dependentSchemas`): closing each part of an intersection leaves only the keys every part
  declares;
- a subschema nested more than `MAX_DEPTH` deep (the rewrite recurses).

A request opens an object by saying so in its schema (`"additionalProperties": true`, or a
schema for the extra values); vLLM's `structured_outputs.disable_additional_properties: false`
compiles a `structured_outputs.json` schema as written (gateway/serving/constraint.py). A model
configured with `closed_objects = false` is sent its guides as written unless the request
chooses itself (gateway/config_tables.py, `Request.guide_on`).

Invariants: the rewrite is a pure function of the schema, applied where the gateway builds a
guide's spec, so the gateway's check and every node compile the same grammar from the same
spec; the client's schema is never modified (a rewritten copy is returned).
"""

from __future__ import annotations

from typing import Any

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
#: keywords by which an object already says what other keys may appear
_CHOSEN = ("additionalProperties", "patternProperties", "unevaluatedProperties")
#: keywords that merge a subschema with its siblings: its own properties are not all it allows
_MERGING = ("$ref", "anyOf", "oneOf", "allOf", "if", "dependentSchemas")
#: deepest subschema closed; deeper ones are left as written
MAX_DEPTH = 64


def close_objects(schema: Any) -> Any:
    """`schema` with every object that lists its properties and omits `additionalProperties`
    closed (a new object; `schema` itself if nothing changes)."""
    out, _ = _close(schema, 0)
    return out


def _close(node: Any, depth: int) -> tuple[Any, bool]:
    """(the node closed, whether anything changed); recursive, at most MAX_DEPTH deep. Keywords
    that intersect schemas (`allOf`, `not`, `if`, ...) are not entered."""
    if not isinstance(node, dict) or depth > MAX_DEPTH:
        return node, False
    out = dict(node)
    changed = False
    for k in _SCHEMA_MAPS:
        if isinstance(m := node.get(k), dict):
            subs = {name: _close(s, depth + 1) for name, s in m.items()}
            if any(c for _, c in subs.values()):
                out[k] = {name: s for name, (s, _) in subs.items()}
                changed = True
    for k in _SCHEMA_ONE:
        if isinstance(s := node.get(k), dict):
            new, c = _close(s, depth + 1)
            if c:
                out[k], changed = new, True
    for k in _SCHEMA_LISTS:
        if isinstance(xs := node.get(k), list):
            news = [_close(s, depth + 1) for s in xs]
            if any(c for _, c in news):
                out[k] = [s for s, _ in news]
                changed = True
    if (
        isinstance(node.get("properties"), dict)
        and not any(k in node for k in _CHOSEN)
        and not any(k in node for k in _MERGING)
    ):
        out["additionalProperties"] = False
        changed = True
    return out, changed
