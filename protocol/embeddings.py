"""The embeddings contracts: OpenAI's public `POST /v1/embeddings`, and the node's internal one.

Public (gateway): `EmbeddingRequest` → `EmbeddingResponse`, OpenAI's shapes. `input` is a
string, an array of strings, an array of token ids, or an array of such arrays (the gateway
checks that the array is one of these, its size and each item's length); `encoding_format`
"float" gives lists of floats, "base64" the little-endian float32 bytes of each vector in
base64 (OpenAI's, and what the official Python client asks for by default).

Internal (gateway → a node started with `--task embed`): `NodeEmbeddingRequest` carries token
ids only (the gateway tokenizes, so usage counts what it reserved) and the `dimensions` to
keep; `NodeEmbeddingResponse` carries each vector as its little-endian float32 bytes (base64 in
JSON: exact, a third of a float list's size), already truncated and L2-normalized.
"""

from __future__ import annotations

import enum
import sys

import msgspec

#: OpenAI's limit on the items of one request
MAX_EMBEDDING_INPUTS = 2048


class EncodingFormat(enum.StrEnum):
    FLOAT = "float"
    BASE64 = "base64"


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    #: str | list[str] | list[int] | list[list[int]]; a mixed array is refused by the gateway
    input: str | list[str | int | list[int]]
    encoding_format: EncodingFormat = EncodingFormat.FLOAT
    dimensions: int | None = None
    user: str | None = None


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: str = "embedding"
    index: int
    #: floats, or base64 of little-endian float32 (encoding_format "base64")
    embedding: list[float] | str


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


class NodeEmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    #: one token-id list per item
    inputs: list[list[int]]
    #: keep the first `dimensions` components (then normalize); None: the model's size
    dimensions: int | None = None


class NodeEmbeddingResponse(msgspec.Struct, kw_only=True):
    model: str
    #: components per vector
    dim: int
    #: one vector per input, in order: `dim` little-endian float32, L2-normalized
    vectors: list[bytes]
    prompt_tokens: int


def le_float32(data: bytes) -> bytes:
    """Little-endian float32 bytes from this machine's float32 bytes (a no-op on x86/ARM)."""
    if sys.byteorder == "little":
        return data
    import array

    a = array.array("f", data)
    a.byteswap()
    return a.tobytes()
