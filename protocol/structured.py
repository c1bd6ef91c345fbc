"""Structured-output contracts shared by the gateway and the nodes.

`ResponseFormat` is OpenAI's `response_format` body field as clients send it; `StructuredOutputs`
is vLLM's `structured_outputs` extra (which replaced its `guided_regex` / `guided_choice` /
`guided_json`). `Guide` is what a node's leg carries: the one constraint the engine enforces with
a token mask every step (the gateway derives it from `response_format`, vLLM's extras —
gateway/serving/constraint.py — or `tool_choice` = `required` / a named function).
A leg carries at most one guide; its `spec` is canonical text (a schema's compact JSON, keys in
the client's order since property order is generation order — text/guide_check.py; a regex;
or a JSON list of choices), so the same constraint hashes to the same compiled grammar on every
node.

Invariant: a guide reaching a node was already checked by the gateway (the grammar engine
accepted it), so a node refusing one is a 400 of the same words, never a crash.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import msgspec


class JSONSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`: `{"name", "schema", "strict", "description"}`."""

    name: str
    #: a JSON Schema, as the client wrote it (JSON Schema is open-ended: checked by the
    #: grammar engine, not by a Struct)
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format`: text (no constraint), a JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputs(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """vLLM's `structured_outputs` body field (vLLM >= 0.10.2), with vLLM's field names: exactly
    one of `json` (a JSON schema, inline or as its JSON text), `regex`, `choice` or
    `json_object: true`. `grammar`, `structural_tag` and `whitespace_pattern` are vLLM's too;
    duet refuses them by name (400) rather than ignore them. `disable_additional_properties`
    (with `json`): true or unset closes the schema's objects that omit `additionalProperties`
    (duet's default), false compiles the schema as written. `disable_any_whitespace` and
    `disable_fallback` change nothing here: duet's JSON is always compact, and there is one grammar
    engine, no fallback.

    The gateway also sends this form, normalized (one field set, `json` an object), to an
    OpenAI-compatible provider whose model serves it (gateway/serving/features.py)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: str | dict[str, Any] | None = None
    whitespace_pattern: str | None = None
    disable_additional_properties: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_fallback: bool | None = None


class GuideKind(enum.StrEnum):
    """What a guide's `spec` holds."""

    JSON_OBJECT = "json_object"  # any JSON object (spec is empty)
    JSON_SCHEMA = "json_schema"  # spec: the schema's compact JSON (text/guide_check.py)
    REGEX = "regex"  # spec: the regular expression
    CHOICE = "choice"  # spec: a JSON list of the allowed strings


class Guide(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """The constraint of one leg: the prefill node masks the first token with it (that token is
    the output's first: D emits it), the decode node resumes it from the tokens sampled so far,
    P's included, and masks the rest."""

    kind: GuideKind
    spec: str = ""
