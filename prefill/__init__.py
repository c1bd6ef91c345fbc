"""The prefill role: its leg of a request (compute the prompt's KV, hold it for a decode node)
and its release endpoint, registered with node/'s app by `register` (node.legs is its API)."""

from __future__ import annotations

from node.legs import PREFILL_TRIGGER, Roles


def register(roles: Roles) -> None:
    from prefill.leg import abort_held, handle_release, prefill_leg

    roles.add_role("prefill")
    roles.add_leg(PREFILL_TRIGGER, prefill_leg)
    roles.add_route("POST", "/kv/release", handle_release)
    roles.on_abort.append(abort_held)
