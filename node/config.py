"""NodeConfig: what an operator sets for one node process (CLI flags map 1:1)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any

from runtime.plane import PlaneSecurity
from runtime.read_deadlines import ReadDeadlines
from text.guide_compile import THREADS as GUIDE_THREADS
from text.guide_compile import TIMEOUT_S as GUIDE_TIMEOUT_S

ROLES = ("prefill", "decode", "both")
FAILURE_POLICIES = ("recompute", "fail")
TASKS = ("generate", "embed")
POOLINGS = ("last", "mean")
#: Peers a decode node may pull from unless the operator says otherwise: loopback and the
#: private ranges (RFC 1918, IPv6 ULA), where a cluster's own nodes live. Public addresses and
#: link-local ones (cloud metadata services) are refused: a client cannot aim a decode node at
#: an arbitrary host.
DEFAULT_ALLOWED_PEERS = "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7"


def parse_networks(spec: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """'127.0.0.0/8,10.1.2.3' → networks (a bare address is a /32 or /128)."""
    nets = []
    for part in spec.split(","):
        part = part.strip()
        if part:
            try:
                nets.append(ipaddress.ip_network(part, strict=False))
            except ValueError as e:
                raise ValueError(f"cannot read peer network {part!r}: {e}") from None
    if not nets:
        raise ValueError(f"empty peer network list {spec!r}")
    return tuple(nets)


@dataclass
class NodeConfig:
    role: str = "both"
    host: str = "127.0.0.1"
    port: int = 8100
    #: address other nodes and the gateway use to reach this one (default: host, or the
    #: machine's name when listening on all interfaces)
    advertise_host: str | None = None
    #: stable across restarts; default "<role>-<hostname>-<port>"
    node_id: str | None = None
    #: which engine adapter runs (node.engines), and its config (engine.EngineConfig for native)
    engine_kind: str = "native"
    engine: Any = None
    transport: str = "nixl"
    #: seconds a prefill node holds finished blocks for a decode node to pull
    lease_seconds: float = 30.0
    #: seconds a decode node waits for one KV pull
    transfer_timeout: float = 10.0
    #: what a decode node does when a pull fails: recompute locally, or fail the request
    failure_policy: str = "recompute"
    #: seconds a decode leg waits for the engine to reserve blocks for the remote KV
    reserve_timeout: float = 30.0
    #: CIDR list of the prefill nodes a decode node may contact (DEFAULT_ALLOWED_PEERS)
    allowed_peers: str = DEFAULT_ALLOWED_PEERS
    #: seconds in-flight requests get to finish after SIGTERM
    grace_period: float = 30.0
    #: CPU ids to pin this process to (e.g. "0-3,8")
    cpus: str | None = None
    #: etcd URL to register with (None: standalone); see node/registration.py
    etcd: str | None = None
    cluster: str = "default"
    #: routing pool label: shared, interactive or batch
    pool: str = "shared"
    exit_when_drained: bool = False
    #: cluster secret, TLS and /metrics policy of the internal plane (runtime/plane.py)
    security: PlaneSecurity = field(default_factory=PlaneSecurity)
    #: deadlines for reading a request's headers and body (slow clients)
    deadlines: ReadDeadlines = field(default_factory=ReadDeadlines)
    #: "generate" (the P/D legs) or "embed" (POST /v1/embeddings only: node/embed.py)
    task: str = "generate"
    #: embed nodes: how a prompt's final hidden states become one vector ("last" or "mean")
    pooling: str = "last"
    #: a guide's grammar check (text/guide_compile.py) runs off the event loop on this many
    #: threads, and one compiling longer than this is a 400 guide_too_complex — the gateway's
    #: `[server] guide_compile_threads` / `guide_compile_timeout_s`, with its defaults
    guide_compile_threads: int = GUIDE_THREADS
    guide_compile_timeout_s: float = GUIDE_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.task == "embed" and self.role != "both":
            raise ValueError(
                "an embedding node has no prefill/decode role: start it with `duet node --task embed`"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure policy must be one of {FAILURE_POLICIES}")
        if self.lease_seconds <= 0 or self.transfer_timeout <= 0 or self.reserve_timeout <= 0:
            raise ValueError("lease, transfer and reserve timeouts must be positive")
        parse_networks(self.allowed_peers)
        if not 0 < self.guide_compile_timeout_s <= 600:
            raise ValueError(
                f"guide compile timeout must be in (0, 600] seconds, got {self.guide_compile_timeout_s}"
            )
        if not 1 <= self.guide_compile_threads <= 64:
            raise ValueError(
                f"guide compile threads must be in [1, 64], got {self.guide_compile_threads}"
            )

    def peer_networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        """The networks a decode leg may contact (`--allowed-peers`)."""
        return parse_networks(self.allowed_peers)

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.host in ("0.0.0.0", "::", "") else self.host

    @property
    def resolved_node_id(self) -> str:
        kind = "embed" if self.task == "embed" else self.role
        return self.node_id or f"{kind}-{socket.gethostname()}-{self.port}"


def parse_cpus(spec: str) -> set[int]:
    """'0-3,8' → {0, 1, 2, 3, 8}."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot read CPU list {spec!r} (try 0-3,8)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {spec!r}")
    return cpus
