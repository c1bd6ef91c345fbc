"""What a node publishes about its KV pool (`GET /kv/metadata`) and what peers send each other.

`TransportMetadata` is everything a reader needs to pull blocks from the owner: who it is
(engine id), how to reach it (backend name, NIXL agent blob or host/port), and what the
pool looks like (`KVLayout` + compatibility hash). It is encoded as JSON (bytes fields are
base64) so operators can `curl` it. Invariants: `compat_hash == layout.compat_hash` for
metadata produced by a transport; `decode_metadata` rejects anything else with a
`TransferError`, so a reader never acts on a half-understood blob.
"""

from __future__ import annotations

import msgspec

from kvtransfer.errors import TransferError
from protocol.kv_layout import KVLayout

#: Bumped when the meaning of a field changes; readers refuse other versions.
METADATA_VERSION = 1

#: HTTP content type of an encoded `TransportMetadata`.
METADATA_CONTENT_TYPE = "application/json"


class TransportMetadata(msgspec.Struct, frozen=True, kw_only=True):
    engine_id: str
    backend: str  # "nixl" | "ucx" | "tcp"
    layout: KVLayout
    compat_hash: str
    device: str  # "cpu" | "cuda:N" (of the owner's pool)
    base_address: int  # pool base in the owner's address space (NIXL descriptors)
    host: str = ""  # tcp/ucx listener address
    port: int = 0
    agent_metadata: bytes = b""  # NIXL agent metadata (connection info + memory keys)
    version: int = METADATA_VERSION


class Notification(msgspec.Struct, frozen=True, kw_only=True):
    """A small message a peer sent to this node (e.g. "release the blocks of request r")."""

    engine_id: str  # the sender
    message: bytes


_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(TransportMetadata)


def encode_metadata(metadata: TransportMetadata) -> bytes:
    return _ENCODER.encode(metadata)


def decode_metadata(data: bytes | str) -> TransportMetadata:
    """Parse what `GET /kv/metadata` returned; raises `TransferError` on anything malformed."""
    try:
        md = _DECODER.decode(data)
    except msgspec.DecodeError as e:
        raise TransferError(f"invalid KV transport metadata: {e}") from None
    if md.version != METADATA_VERSION:
        raise TransferError(
            f"KV transport metadata of {md.engine_id!r} has version {md.version}, "
            f"this node understands {METADATA_VERSION}"
        )
    if md.compat_hash != md.layout.compat_hash:
        raise TransferError(
            f"KV transport metadata of {md.engine_id!r} is inconsistent: compat_hash "
            f"{md.compat_hash} does not match its layout ({md.layout.compat_hash})"
        )
    return md
