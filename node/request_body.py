"""Decoding a request body on a node (completion or chat form) into its msgspec type.

Anything the decoder refuses is the client's 400; a field of `kv_transfer_params` that does not
fit its type is named as `param: "kv_transfer_params"`, as the legs' own checks name it.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from protocol.openai import APIError

T = TypeVar("T")
_KV_PATH = "$.kv_transfer_params"


def decode_request(decoder: msgspec.json.Decoder[T], raw: bytes) -> T:
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as e:  # a subclass of DecodeError: first
        if _KV_PATH in str(e):
            raise APIError(
                400, f"invalid kv_transfer_params: {e}", param="kv_transfer_params"
            ) from None
        raise APIError(400, f"malformed request body: {e}") from None
    except msgspec.DecodeError as e:
        raise APIError(400, f"malformed request body: {e}") from None
