"""The role API: how the prefill and decode roles plug into the node app — the only node module
prefill/ and decode/ import besides node.engine_api (tests/nodes/test_layering.py enforces it).

node/ never imports prefill/ or decode/ (lower layers never import upper ones). Instead the
composition root (duet.cmd_nodes) calls each role's `register(roles)`, which adds:
- a leg: the handler of `/v1/completions` requests whose `kv_transfer_params` carry the role's
  trigger flag (`do_remote_decode` → prefill leg, `do_remote_prefill` → decode leg). A leg gets
  a `LegContext`: the validated request (`Prepared`), the node (`Node`), and the calls that
  queue the request in the engine and answer (whole, streamed, or an error event in a stream);
- routes of its own (`POST /kv/release`);
- lifecycle hooks (run after the engine and transport start, before they stop) and abort
  hooks (`POST /abort` asks every role to drop what it holds for a request id).
A role keeps its own state in `Node.role_state`, one object per type (`RoleStates`).
A trigger no registered role serves is the client's 400.

Engine request ids: a prefill leg runs as "prefill:<X-Request-Id>", everything else as the
X-Request-Id itself, so a colocated node can serve both legs of one request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from node.engine_api import EngineStream, KVHandoff, NodeEngine
from node.remote_kv import PeerUnreachable as PeerUnreachable  # the roles' name for it
from node.remote_kv import RemoteKV
from protocol.kv_params import KVTransferParams
from protocol.node_api import NodeCompletion, NodeCompletionRequest
from protocol.openai import APIError
from protocol.sampling import Priority, SamplingParams

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

    from kvtransfer import Transport
    from node.config import NodeConfig
    from node.metrics import NodeMetrics
    from runtime.tracing import Tracing

T = TypeVar("T")

#: the kv_transfer_params flags that select a leg (vLLM's names)
PREFILL_TRIGGER = "do_remote_decode"
DECODE_TRIGGER = "do_remote_prefill"
TRIGGERS = (PREFILL_TRIGGER, DECODE_TRIGGER)


def prefill_request_id(request_id: str) -> str:
    """The engine request id of the prefill leg of `request_id`."""
    return f"prefill:{request_id}"


def leg_trigger(kv: KVTransferParams | None) -> str | None:
    """The leg a request asks for: its kv_transfer_params' flag, or None (both are refused when
    the request is prepared)."""
    if kv is None:
        return None
    return (
        PREFILL_TRIGGER if kv.do_remote_decode else DECODE_TRIGGER if kv.do_remote_prefill else None
    )


@dataclass
class Prepared:
    """A validated request, ready for a leg."""

    request_id: str
    body: NodeCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams
    priority: Priority
    arrival: float
    #: answer in the chat shape (the request came to /v1/chat/completions)
    chat: bool = False
    #: stream in vLLM's generate shape under this request id (the request came to
    #: /inference/v1/generate)
    generate_id: str | None = None
    #: and the prompt's ids go with its first event (vLLM's `return_token_ids`)
    generate_prompt_ids: bool = False

    @property
    def kv_params(self) -> KVTransferParams | None:
        return self.body.kv_transfer_params


class RoleStates:
    """Each role's own state on a node, one object per type: `put(RemoteKV(...))` at start,
    `get(RemoteKV)` in the leg — typed, and no role sees another's by a string key."""

    def __init__(self) -> None:
        self._by_type: dict[type, object] = {}

    def put(self, value: object) -> None:
        self._by_type[type(value)] = value

    def get(self, kind: type[T]) -> T | None:
        value = self._by_type.get(kind)
        return value if isinstance(value, kind) else None


class Membership(Protocol):
    """The cluster's registered nodes as this node sees them (node.members.ClusterMembers, a
    mirror of etcd's registrations): a decode node pulls KV only from a registered node."""

    @property
    def listed(self) -> bool:
        """The registrations were read at least once (before that, nothing is known)."""
        ...

    def kv_source(self, engine_id: str) -> tuple[str, int] | None:
        """(host, port) of the URL of the registered prefill-capable node running `engine_id`,
        or None when no such node is registered."""
        ...

    def kv_hosts(self) -> set[str]:
        """The hosts (as their URLs name them) of every registered prefill-capable node: what an
        engine that moves KV itself (vLLM, whose engine ids are its own) may contact."""
        ...

    def kv_peer(self, engine_id: str) -> tuple[str, int] | None:
        """(host, port) of the URL of the registered node, of any role, running `engine_id`:
        where a node may pull a shared prefix from."""
        ...


class Node(Protocol):
    """What a role sees of its node (node.state.NodeState is the one implementation)."""

    config: NodeConfig
    engine: NodeEngine
    metrics: NodeMetrics
    engine_id: str
    #: the KV transport; None on a node that moves no KV (or whose engine moves it itself)
    transport: Transport | None
    #: reads peers' KV through the transport (None without one)
    remote_kv: RemoteKV | None
    session: aiohttp.ClientSession | None
    role_state: RoleStates
    #: the cluster's registered nodes; None on a node without a cluster (no --etcd)
    members: Membership | None
    tracing: Tracing

    def enter(self, engine_request_id: str) -> None:
        """Count work in flight from here to `leave` (a draining node waits for it): for a
        role's own route; a leg is counted by the node."""
        ...

    def leave(self, engine_request_id: str) -> None: ...


class LegContext(Protocol):
    """One leg of one request, as its role handles it (node.leg_context.Leg implements it). The
    node counts the leg in flight from dispatch to answer; `abort` drops the engine request."""

    request: web.Request
    prep: Prepared
    #: "prefill:<id>" on a prefill leg, the request id otherwise
    engine_request_id: str

    # read-only, so that an implementation may hold a richer node and compute the timing
    @property
    def node(self) -> Node: ...

    @property
    def timing(self) -> dict[str, float]:
        """Seconds since arrival, reported in the answer's `timing` (a decode leg adds queue_s
        and transfer_s; the rest is filled in when the answer finishes)."""
        ...

    async def start(self, params: SamplingParams, handoff: KVHandoff | None = None) -> EngineStream:
        """Queue the request in the engine, with its part in a P/D handoff (a request the engine
        refuses is the client's 400)."""
        ...

    async def respond(self, stream: EngineStream) -> web.StreamResponse:
        """The answer the client asked for: streamed or whole, completion or chat."""
        ...

    async def collect(self, stream: EngineStream) -> NodeCompletion:
        """The whole answer, for a leg that adds to it before answering (`answer`)."""
        ...

    def answer(self, result: NodeCompletion) -> web.Response:
        """`result` as the JSON answer, in the shape the client asked for."""
        ...

    async def stream_error(self, err: APIError) -> web.StreamResponse:
        """A streamed answer holding only `err` (an SSE error event, then [DONE])."""
        ...

    async def abort(self) -> None: ...


LegHandler = Callable[[LegContext], Awaitable["web.StreamResponse"]]
RouteHandler = Callable[[Node, "web.Request"], Awaitable["web.StreamResponse"]]
Hook = Callable[[Node], Awaitable[None]]
AbortHook = Callable[[Node, str], Awaitable[bool]]


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
