"""Control messages of the message-based backends (tcp, ucx) and their framing.

Block bytes never go through msgspec: a `ReadRequest` is answered by a `Reply` and then
the raw bytes, straight from the owner's pool into the reader's (tcp: one stream in request
order; ucx: one tagged message per run). The owner validates ids again on its side, so a
reader with stale metadata gets an error reply, never someone else's memory.
"""

from __future__ import annotations

import struct

import msgspec


class ReadRequest(msgspec.Struct, frozen=True, kw_only=True, tag="read", array_like=True, gc=False):
    req_id: int
    #: tcp: block ids in stream order; ucx: runs as flat [start0, count0, start1, count1, …].
    blocks: list[int]


class NotifyRequest(
    msgspec.Struct, frozen=True, kw_only=True, tag="notify", array_like=True, gc=False
):
    req_id: int
    sender: str
    message: bytes


class Reply(msgspec.Struct, frozen=True, kw_only=True, tag="reply", array_like=True, gc=False):
    req_id: int
    error: str = ""  # empty: accepted (for reads the bytes follow)
    nbytes: int = 0


class Challenge(
    msgspec.Struct, frozen=True, kw_only=True, tag="challenge", array_like=True, gc=False
):
    """tcp handshake, owner → reader, first on every connection: the owner's fresh nonce."""

    nonce: bytes


class Hello(msgspec.Struct, frozen=True, kw_only=True, tag="hello", array_like=True, gc=False):
    """tcp handshake, reader → owner: its own nonce and the MAC proving the cluster secret."""

    nonce: bytes
    mac: bytes


class Welcome(msgspec.Struct, frozen=True, kw_only=True, tag="welcome", array_like=True, gc=False):
    """tcp handshake, owner → reader: the owner's proof of the same secret over both nonces."""

    mac: bytes


Message = ReadRequest | NotifyRequest | Reply | Challenge | Hello | Welcome

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)

#: Little-endian u32 length before each tcp control message.
FRAME_HEADER = struct.Struct("<I")
MAX_FRAME = 64 * 1024 * 1024


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    return _DECODER.decode(data)


def frame(msg: Message) -> bytes:
    body = _ENCODER.encode(msg)
    return FRAME_HEADER.pack(len(body)) + body


def check_blocks(block_ids: list[int], num_blocks: int) -> str:
    """Owner-side check of requested ids; returns an error message, empty when all valid."""
    for b in block_ids:
        if not 0 <= b < num_blocks:
            return f"block id {b} is out of range [0, {num_blocks}) of the owner's pool"
    return ""
