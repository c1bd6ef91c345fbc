"""The decode role: its leg of a request (pull P's KV, release it, decode and stream),
registered with node/'s app by `register` (node.legs is its API; it reads P's blocks through the
node's `remote_kv`, the peer policy and metadata cache every node with a transport has)."""

from __future__ import annotations

from node.legs import DECODE_TRIGGER, Roles


def register(roles: Roles) -> None:
    from decode.leg import decode_leg

    roles.add_role("decode")
    roles.add_leg(DECODE_TRIGGER, decode_leg)
