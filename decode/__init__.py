"""The decode role: its leg of a request (pull P's KV, release it, decode and stream), with the
peer policy and the metadata cache, registered with node/'s app by `register` (node.legs is its
API; its state on a node is one RemoteKV)."""

from __future__ import annotations

from node.legs import DECODE_TRIGGER, Node, Roles


async def _start(node: Node) -> None:
    from decode.peers import PeerPolicy
    from decode.remote_kv import RemoteKV

    if node.transport is None or node.session is None:
        return
    policy = PeerPolicy(node.config.peer_networks())
    node.role_state.put(
        RemoteKV(
            node.transport,
            node.session,
            node.config.transfer_timeout_s,
            policy,
            node.config.security.scheme,
        )
    )


def register(roles: Roles) -> None:
    from decode.leg import decode_leg

    roles.add_role("decode")
    roles.add_leg(DECODE_TRIGGER, decode_leg)
    roles.on_start.append(_start)
