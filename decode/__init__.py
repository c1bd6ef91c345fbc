"""The decode role: its leg of a request (pull P's KV, release it, decode and stream), with the
peer policy and the metadata cache, registered with node/'s app by `register`."""

from __future__ import annotations

from node.legs import Roles
from node.state import NodeState


async def _start(state: NodeState) -> None:
    from decode.peers import PeerPolicy
    from decode.remote_kv import RemoteKV
    from node.config import parse_networks

    if state.transport is None or state.session is None:
        return
    policy = PeerPolicy(parse_networks(state.config.allowed_peers))
    state.role_state["decode"] = RemoteKV(state.transport, state.session, state.config.transfer_timeout, policy)


def register(roles: Roles) -> None:
    from decode.leg import decode_leg

    roles.add_role("decode")
    roles.add_leg("do_remote_prefill", decode_leg)
    roles.on_start.append(_start)
