"""Role registration: how the prefill and decode roles plug into the node app.

node/ never imports prefill/ or decode/ (lower layers never import upper ones). Instead the
composition root (duet.cmd_nodes) calls each role's `register(roles)`, which adds:
- a leg: the handler of `/v1/completions` requests whose `kv_transfer_params` carry the role's
  trigger flag (`do_remote_decode` → prefill leg, `do_remote_prefill` → decode leg);
- routes of its own (`GET /kv/metadata`, `POST /kv/release`);
- lifecycle hooks (run after the engine and transport start, before they stop) and abort
  hooks (`POST /abort` asks every role to drop what it holds for a request id).
A trigger no registered role serves is the client's 400.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

    from node.completions import Prepared
    from node.state import NodeState

LegHandler = Callable[["NodeState", "web.Request", "Prepared"], Awaitable["web.StreamResponse"]]
RouteHandler = Callable[["NodeState", "web.Request"], Awaitable["web.StreamResponse"]]
Hook = Callable[["NodeState"], Awaitable[None]]
AbortHook = Callable[["NodeState", str], Awaitable[bool]]

#: the kv_transfer_params flags that select a leg (vLLM's names)
TRIGGERS = ("do_remote_decode", "do_remote_prefill")


@dataclass
class Roles:
    names: list[str] = field(default_factory=list)
    legs: dict[str, LegHandler] = field(default_factory=dict)
    routes: list[tuple[str, str, RouteHandler]] = field(default_factory=list)
    on_start: list[Hook] = field(default_factory=list)
    on_stop: list[Hook] = field(default_factory=list)
    on_abort: list[AbortHook] = field(default_factory=list)

    def add_role(self, name: str) -> None:
        if name in self.names:
            raise ValueError(f"role {name!r} is registered twice")
        self.names.append(name)

    def add_leg(self, trigger: str, handler: LegHandler) -> None:
        if trigger not in TRIGGERS:
            raise ValueError(f"unknown leg trigger {trigger!r}; expected one of {TRIGGERS}")
        if trigger in self.legs:
            raise ValueError(f"a leg for {trigger!r} is registered already")
        self.legs[trigger] = handler

    def add_route(self, method: str, path: str, handler: RouteHandler) -> None:
        self.routes.append((method, path, handler))

    def describe(self) -> str:
        return "+".join(self.names) or "no role"


#: what a role module exposes: `register(roles)`
Register = Callable[[Roles], Any]
