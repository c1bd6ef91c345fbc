"""Bodies of the nodes' internal HTTP API (DESIGN §4) besides /v1/completions.

Internal requests are refused on unknown fields (a typo must not turn into a silent no-op)."""

from __future__ import annotations

import msgspec


class KVReleaseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Decode node → prefill node: the blocks of `request_id` were pulled (or are not wanted).
    `block_ids`, when given, must be exactly the blocks held for that request."""

    request_id: str
    block_ids: list[int] | None = None


class AbortRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    request_id: str


class NodeHealth(msgspec.Struct, kw_only=True):
    status: str  # ok | draining | failed
    role: str
    node_id: str
    engine_id: str
    model: str
    detail: str | None = None
