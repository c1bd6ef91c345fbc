"""From `response_format` to a `Guide`, and the tokenizer-free check of a guide.

The gateway calls `guide_from_response_format` (or `choice_guide`, for vLLM's choice fields:
gateway/serving/constraint.py) and checks the guide before any node work, so an invalid or
unsupported schema, regex or list of choices is a 400 naming what is wrong and the field it came
from. It runs `grammar_error_uncached` off its event loop, bounded in threads and time, with its own
cache (text/guide_compile.py: a pathological schema compiles for seconds), and so does a
node for every leg's guide; `check_guide` is the synchronous form, cached in `_grammar_error`,
for code with no event loop to keep serving. The check compiles the guide's grammar with
llguidance — the same engine, through the same `guide_grammar`, that the nodes' engine masks
logits with (engine/guided.py) — only without a tokenizer, so a guide the gateway passes is one
every node accepts (protocol/structured.py's invariant). llguidance imports no torch (xgrammar
does), which is what lets the gateway run it.

A schema is compiled as `text/json_bounds.py::bound_numbers` rewrites it: a number with
bounds gets at most 10 digits after its point, so no answer runs on inside one (a pure function
of the spec, so the caches keyed by the spec stay right).

Canonical specs: a schema is its compact JSON (no spaces) with keys in the client's order — not
sorted, because property order is the order the output is generated in (see canonical_schema);
the same schema text hashes to the same compiled grammar on every node. Checks are cached per
(kind, spec) in a bounded LRU: clients resend the same schema with every request. The size
bounds below keep the slowest admitted compile to about a second (docs/structured-outputs.md,
Limits: one object of 9,800 optional properties took 13 s).

Invariant: `check_guide` either returns (the engine accepts the grammar) or raises APIError(400);
with llguidance missing it raises too — never an unchecked, unconstrained pass-through.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from protocol.openai import APIError
from protocol.structured import Guide, GuideKind, ResponseFormat
from text.json_bounds import bound_numbers
from text.json_closed import close_objects

log = logging.getLogger("duet.guide")

#: longest spec a guide may carry (characters): a schema larger than this is no API request
MAX_SPEC_CHARS = 100_000
#: most strings a `choice` guide may list, and most characters in one of them: a choice is a
#: label or a short answer, and every one becomes an alternative of the compiled grammar
MAX_CHOICES = 1_000
MAX_CHOICE_CHARS = 1_000
#: most properties one object of a JSON schema may declare: llguidance's compile time grows with
#: the square of an object's optional properties (9,800 of them, 97k characters, took 13 s on
#: the 2-core dev machine; 1,000 take ~0.3 s). OpenAI allows 5,000 in a whole schema.
MAX_OBJECT_PROPERTIES = 1_000
#: longest regular expression a `regex` guide may carry (characters)
MAX_REGEX_CHARS = 10_000
#: compact JSON: no whitespace between tokens, so a small model cannot pad its output with it
JSON_DEFAULTS = {"whitespace_flexible": False}
_PARAM = "response_format"


class GrammarEngineMissing(RuntimeError):
    """llguidance cannot be imported: guided requests cannot be served here."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - installed with duet
        raise GrammarEngineMissing(
            f"the grammar engine llguidance cannot be imported: {e}"
        ) from None
    return llguidance


def canonical_schema(schema: Any) -> str:
    """The schema's compact JSON, keys in the client's order: the grammar emits an object's
    properties in schema order (as OpenAI's structured outputs do: "reasoning" before "answer"
    is a prompt), so sorting them would change what the model writes, not only the cache key."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def guide_from_response_format(rf: ResponseFormat | None) -> Guide | None:
    """The guide a `response_format` asks for: None for text, a JSON object guide, or a JSON
    schema guide with the schema in canonical form."""
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return Guide(kind=GuideKind.JSON_OBJECT)
    js = rf.json_schema
    if js is None:
        raise APIError(
            400, "response_format of type json_schema needs a json_schema object", param=_PARAM
        )
    if js.schema is None:
        raise APIError(400, "response_format.json_schema needs a schema", param=_PARAM)
    return json_schema_guide(js.schema)


def json_schema_guide(schema: Any, closed: bool = True) -> Guide:
    """A JSON-schema guide in canonical form; `closed`: an object that lists its properties and
    omits `additionalProperties` allows no other key (text/json_closed.py: duet's default, as
    xgrammar's strict mode and OpenAI's strict structured outputs read such a schema)."""
    return Guide(
        kind=GuideKind.JSON_SCHEMA,
        spec=canonical_schema(close_objects(schema) if closed else schema),
    )


def check_choices(choices: object) -> list[str]:
    """`choices` if it is a list of 1..MAX_CHOICES non-empty strings of at most MAX_CHOICE_CHARS
    characters each; else ValueError saying which bound it breaks."""
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError("the choices must be a list of strings")
    if not choices:
        raise ValueError("the list of choices is empty: give at least one string")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"at most {MAX_CHOICES} choices are allowed, got {len(choices)}")
    for i, c in enumerate(choices):
        if not c:
            raise ValueError(f"choice {i} is empty (an empty answer cannot be chosen)")
        if len(c) > MAX_CHOICE_CHARS:
            raise ValueError(f"choice {i} is {len(c)} characters long; at most {MAX_CHOICE_CHARS}")
    return choices


def choice_guide(choices: list[str]) -> Guide:
    """A choice guide in canonical form (a compact JSON list, in the client's order);
    ValueError as `check_choices`."""
    return Guide(
        kind=GuideKind.CHOICE,
        spec=json.dumps(check_choices(choices), separators=(",", ":"), ensure_ascii=False),
    )


def _choices(spec: str) -> list[str]:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"a choice guide's spec must be a JSON list of strings: {e}") from None
    return check_choices(choices)


def guide_grammar(guide: Guide) -> str:
    """The llguidance grammar (its JSON text) that enforces `guide`; raises ValueError for a
    spec that is not even well-formed (not JSON, too long, an empty choice list)."""
    if len(guide.spec) > MAX_SPEC_CHARS:
        raise ValueError(
            f"the {guide.kind.value} spec is {len(guide.spec)} characters; at most {MAX_SPEC_CHARS}"
        )
    m = _llguidance().LLMatcher
    match guide.kind:
        case GuideKind.JSON_OBJECT:
            return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        case GuideKind.JSON_SCHEMA:
            try:
                schema = json.loads(guide.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema must be an object or a boolean")
            _check_widths(schema)
            # bounded numbers get a bounded fraction (text/json_bounds.py): here, so the
            # gateway's check and every node compile the same grammar from the same spec
            return m.grammar_from_json_schema(bound_numbers(schema), defaults=JSON_DEFAULTS)
        case GuideKind.REGEX:
            if not guide.spec:
                raise ValueError("the regular expression is empty")
            if len(guide.spec) > MAX_REGEX_CHARS:
                raise ValueError(
                    f"the regular expression is {len(guide.spec)} characters long; "
                    f"at most {MAX_REGEX_CHARS}"
                )
            return m.grammar_from_regex(guide.spec)
        case GuideKind.CHOICE:
            alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in _choices(guide.spec))
            return m.grammar_from_lark(f"start: {alts}")
    raise ValueError(f"unknown guide kind {guide.kind!r}")  # pragma: no cover - GuideKind is closed


def _check_widths(schema: object) -> None:
    """ValueError if an object in `schema` declares more than MAX_OBJECT_PROPERTIES properties
    (a walk without recursion: a deep schema must not exhaust the stack here)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict) and len(props) > MAX_OBJECT_PROPERTIES:
                raise ValueError(
                    f"an object of the schema declares {len(props)} properties; at most "
                    f"{MAX_OBJECT_PROPERTIES}"
                )
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def grammar_error(guide: Guide) -> str | None:
    """Why the grammar engine refuses `guide` (None: it accepts it). Cached: see check_guide."""
    return _grammar_error(guide.kind, guide.spec)


@functools.lru_cache(maxsize=512)
def _grammar_error(kind: GuideKind, spec: str) -> str | None:
    return grammar_error_uncached(Guide(kind=kind, spec=spec))


def grammar_error_uncached(guide: Guide) -> str | None:
    """`grammar_error` without the cache: the compile itself (text/guide_compile.py runs
    it on its threads and keeps its own cache of verdicts)."""
    try:
        grammar = guide_grammar(guide)
        failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar)
    except ValueError as e:
        return str(e)
    except RecursionError:
        return "the schema is nested too deeply"
    if failed:
        return "; ".join(m.strip() for m in messages) or "the grammar engine refused it"
    return None


def check_guide(guide: Guide | None, param: str = _PARAM) -> None:
    """Raise APIError(400, naming what is wrong, `param`) unless the grammar engine accepts
    `guide` (None: nothing to check)."""
    if guide is None:
        return
    try:
        why = grammar_error(guide)
    except GrammarEngineMissing as e:
        raise APIError(400, f"structured outputs are not available: {e}", param=param) from None
    if why is not None:
        what = WHAT[guide.kind]
        raise APIError(400, f"unsupported or invalid {what}: {why}", param=param)


#: what a refused guide is called in a 400 (its `param` names the request field)
WHAT = {
    GuideKind.JSON_OBJECT: "JSON object guide",
    GuideKind.JSON_SCHEMA: "JSON schema",
    GuideKind.REGEX: "regular expression",
    GuideKind.CHOICE: "list of choices",
}
