"""The client's raw JSON body, before any check: the one place in the request path where a body
is an untyped JSON object. Each public API decodes its body here (`decode_json`), refuses the
fields it does not serve by name (`refuse_unsupported`, `unknown_fields`), reads vLLM's
structured-output extras typed (`vllm_fields`), and converts what is left into its request
struct (`convert`); from there on every seam is typed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import msgspec

from gateway.serving.constraint import VLLM_FIELDS, VllmFields
from protocol.openai import APIError

_DECODE = msgspec.json.Decoder()


def _neutral(v: Any) -> bool:
    return v is None or v is False or v == 0 or v == [] or v == {} or v == {"type": "text"}


def decode_json(raw: bytes, code: str | None = "invalid_json") -> dict[str, Any]:
    """The body as a JSON object, or a 400 (with the API's error `code` for a malformed body)."""
    try:
        data = _DECODE.decode(raw)
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: nested past the parser
        raise APIError(400, f"malformed JSON body: {e}", code=code) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code=code)
    return data


def refuse_unsupported(data: dict[str, Any], allowed: set[str]) -> None:
    bad = sorted(k for k, v in data.items() if k not in allowed and not _neutral(v))
    if bad:
        # the names are the client's: any that is not a plain name is quoted (repr), so a name
        # cannot forge a line in the log
        names = ", ".join(k if k.isidentifier() else repr(k) for k in bad)
        raise APIError(
            400,
            f"unsupported field{'s' if len(bad) > 1 else ''}: {names} "
            "(duet serves text generation only)",
            param=bad[0],
            code="unsupported_field",
        )


def convert(data: dict[str, Any], cls: type) -> Any:
    try:
        return msgspec.convert(data, cls)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = (
            msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
            if "`$." in msg
            else None
        )
        raise APIError(400, f"invalid request: {msg}", param=param) from None


def unknown_fields(
    top: dict[str, Any], known: Collection[str], neutral: Callable[[object], bool]
) -> list[str]:
    """The top-level fields this gateway does not serve, sorted — but not one sent with a value
    that asks for nothing (`neutral`: null, false, empty…), which clients add by default."""
    return sorted(k for k, v in top.items() if k not in known and not neutral(v))


def vllm_fields(data: dict[str, Any]) -> VllmFields:
    """vLLM's fields of a raw request body, typed (400 naming the field whose type is wrong)."""
    sent = {k: data[k] for k in VLLM_FIELDS if data.get(k) is not None}
    if not sent:
        return VllmFields()
    try:
        return msgspec.convert(sent, VllmFields)
    except msgspec.ValidationError as e:
        where = str(e).rsplit("`$.", 1)[1].rstrip("`") if "`$." in str(e) else next(iter(sent))
        raise APIError(400, f"invalid request: {e}", param=where.split("[")[0]) from None
