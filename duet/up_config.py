"""The layout `duet up` starts: which node groups, how many coordinators, which ports and
CPUs — from flags (`--prefill N --decode M`, `--colocated`) or from `cluster.toml`.

cluster.toml (every section optional; unknown keys are refused, so a typo never passes):

    model = "smollm2-135m-instruct"     # default model of every node group
    cluster = "default"                 # etcd key prefix /duet/NAME/

    [gateway]
    host = "127.0.0.1"
    port = 8000
    count = 2                           # gateway processes on that port (default: 2 with >= 4 CPUs)
    routing = "coordinator"             # or "static": least-loaded, prefix-blind (A/B baseline)
    input_usd_per_mtok = 0.0            # prices the gateway bills at, per model
    output_usd_per_mtok = 0.0

    [coordinator]
    replicas = 1
    args = ["--local-prefill-tokens", "128"]    # extra `duet coordinator` flags

    [etcd]
    members = 3                         # one etcd member (default), or a cluster of 3 or 5

    [restart]                           # what `duet up` does when a process dies
    max_restarts = 5                    # failures in a row before it stays down (0: never restart)
    backoff_s = 1.0                     # first delay, doubled per failure in a row ...
    backoff_max_s = 30.0                # ... up to this
    stable_s = 60.0                     # a life healthy this long clears the count
    startup_timeout_s = 180.0           # a restarted process not healthy by then is killed
    liveness_timeout_s = 60.0           # one not answering /health this long is killed (0: never)
    gateway_liveness_timeout_s = 10.0   # sooner for a gateway: a frozen one gets connections

    [[nodes]]
    role = "prefill"                    # prefill | decode | both
    count = 2
    pool = "shared"                     # shared | interactive | batch
    model = "smollm2-135m-instruct"     # default: the top-level model
    cpus = "0-3"                        # pin; default: an even share of this machine's CPUs
    threads = 4                         # default: the pinned CPUs' count
    kv_memory = "1GiB"                  # or kv_blocks = 4096
    args = ["--max-num-seqs", "64"]     # extra `duet node` flags

    [[nodes]]
    role = "decode"

    [[nodes]]
    role = "embed"                      # `duet node --task embed`: POST /v1/embeddings only
    model = "smollm2-135m-instruct"     # served as its own name, or NAME-embed when generation
    pooling = "last"                    # nodes serve the same model; last | mean

Invariant: an `UpConfig` is valid once built — every group has a known role and count >= 1,
at least one node can decode for every model, and the gateway port is a real port.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from duet.supervisor import RestartPolicy
from engine.config import KVCacheDtype
from node.config import Transport
from runtime.models import DEFAULT_MODEL
from runtime.tables import from_table

#: "embed": a node of `--task embed` (its node role is `both`), served as a kind = "embedding"
#: model by the gateway
ROLES = ("prefill", "decode", "both", "embed")
POOLINGS = ("last", "mean")
POOLS = ("shared", "interactive", "batch")


class UpConfigError(ValueError):
    """cluster.toml or the layout flags describe something `duet up` cannot start."""


@dataclass(frozen=True)
class NodeGroup:
    role: str
    count: int = 1
    model: str | None = None
    pool: str = "shared"
    cpus: str | None = None
    threads: int | None = None
    kv_memory: str | None = None
    kv_blocks: int | None = None
    args: tuple[str, ...] = ()
    #: embed groups: last | mean (`duet node --pooling`)
    pooling: str = "last"


@dataclass(frozen=True)
class GatewaySection:
    #: gateway address
    host: str = "127.0.0.1"
    #: gateway port (the OpenAI API)
    port: int = 8000
    #: how the gateway picks nodes: coordinator (prefix- and load-aware) or static (the
    #: gateway's own least-loaded choice among the node URLs, blind to prefixes and with no
    #: conditional prefill: a baseline for benchmarks)
    routing: Literal["coordinator", "static"] = "coordinator"
    #: price the gateway bills per million prompt tokens, USD
    input_usd_per_mtok: float = 0.0
    #: price the gateway bills per million generated tokens, USD
    output_usd_per_mtok: float = 0.0
    #: gateway processes sharing the port (SO_REUSEPORT: the kernel spreads connections; one
    #: that dies is restarted while the others serve) and one store; unset: 2 on a machine with
    #: 4 or more CPUs, else 1
    count: int | None = field(default=None, metadata={"flag": "gateways", "metavar": "N"})


#: CPUs from which `duet up` starts two gateways by default: a gateway's share beside the nodes
TWO_GATEWAYS_FROM_CPUS = 4


def default_gateways(n_cpus: int) -> int:
    """Two gateways where the machine has the cores for a second one, so that a gateway's death
    costs only its in-flight requests; one on a smaller machine."""
    return 2 if n_cpus >= TWO_GATEWAYS_FROM_CPUS else 1


@dataclass(frozen=True)
class EtcdSection:
    #: etcd members duet up runs: 1, or an odd number (3, 5) that keeps its quorum when one is
    #: lost; clients are given every member
    members: int = 1


@dataclass(frozen=True)
class CoordinatorSection:
    #: coordinator replicas (all route; one, elected in etcd, leads)
    replicas: int = 1
    #: one more `duet coordinator` flag, repeatable (e.g. --coordinator-arg=--stale-load-s=3)
    args: tuple[str, ...] = field(default=(), metadata={"flag": "arg", "metavar": "FLAG"})


@dataclass(frozen=True)
class UpConfig:
    #: default model of every node group: registry name, .gguf file or HF directory
    model: str = DEFAULT_MODEL
    #: cluster name in etcd (key prefix /duet/NAME/)
    cluster: str = "default"
    gateway: GatewaySection = GatewaySection()
    coordinator: CoordinatorSection = CoordinatorSection()
    etcd: EtcdSection = EtcdSection()
    nodes: tuple[NodeGroup, ...] = (NodeGroup(role="prefill"), NodeGroup(role="decode"))
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    #: KV pool per node, e.g. 512MiB (a group's kv_memory or kv_blocks wins)
    kv_memory: str = "1GiB"
    #: KV pool per node in blocks (overrides --kv-memory)
    kv_blocks: int | None = None
    #: every node's dtype: auto, bfloat16 or float32
    dtype: str = "auto"
    #: every node's KV cache dtype (`duet node --kv-cache-dtype`): auto (the model's dtype) or
    #: int8 (~2x the tokens of bf16 in --kv-memory); one value for the cluster, since prefill
    #: and decode nodes must agree
    kv_cache_dtype: KVCacheDtype = "auto"
    #: KV transport between the nodes
    transport: Transport = "nixl"
    #: torch threads per node (default: the node's CPU share)
    threads: int | None = None
    #: one more `duet node` flag for every node, repeatable (e.g. --node-arg=--max-num-seqs=64)
    node_args: tuple[str, ...] = field(default=(), metadata={"flag": "node-arg", "metavar": "FLAG"})

    def models(self) -> list[str]:
        return sorted({g.model or self.model for g in self.nodes})

    def generation_models(self) -> list[str]:
        return sorted({g.model or self.model for g in self.nodes if g.role != "embed"})

    def embedding_models(self) -> list[str]:
        return sorted({g.model or self.model for g in self.nodes if g.role == "embed"})

    def describe(self) -> str:
        label = {
            "prefill": "prefill",
            "decode": "decode",
            "both": "colocated",
            "embed": "embedding",
        }
        return ", ".join(
            f"{g.count} {label[g.role]}" + (f" ({g.model})" if g.model else "") for g in self.nodes
        )


def layout_from_flags(
    prefill: int | None, decode: int | None, colocated: int | None
) -> tuple[NodeGroup, ...]:
    """`--colocated [N]` alone, or `--prefill N --decode M` (each defaults to 1)."""
    if colocated is not None:
        if prefill is not None or decode is not None:
            raise UpConfigError(
                "--colocated runs prefill and decode in the same nodes: "
                "do not combine it with --prefill/--decode"
            )
        return (NodeGroup(role="both", count=colocated),)
    groups = []
    for role, n in (
        ("prefill", 1 if prefill is None else prefill),
        ("decode", 1 if decode is None else decode),
    ):
        if n < 0:
            raise UpConfigError(f"--{role} must be >= 0")
        if n:
            groups.append(NodeGroup(role=role, count=n))
    return tuple(groups)


def _table(cls: type, where: str, data: Any) -> Any:
    return from_table(
        cls, data, where, UpConfigError, item=str
    )  # arguments are strings on a command line


def parse_cluster_toml(data: dict[str, Any], base: UpConfig) -> UpConfig:
    known = {"model", "cluster", "gateway", "coordinator", "etcd", "nodes", "restart"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise UpConfigError(
            f"unknown keys: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    cfg = replace(
        base,
        model=str(data.get("model", base.model)),
        cluster=str(data.get("cluster", base.cluster)),
    )
    if "gateway" in data:
        cfg = replace(cfg, gateway=_table(GatewaySection, "[gateway]", data["gateway"]))
    if "coordinator" in data:
        cfg = replace(
            cfg, coordinator=_table(CoordinatorSection, "[coordinator]", data["coordinator"])
        )
    if "etcd" in data:
        cfg = replace(cfg, etcd=_table(EtcdSection, "[etcd]", data["etcd"]))
    if "restart" in data:
        cfg = replace(cfg, restart=_table(RestartPolicy, "[restart]", data["restart"]))
    if "nodes" in data:
        if not isinstance(data["nodes"], list):
            raise UpConfigError("`nodes` must be an array of tables: [[nodes]]")
        cfg = replace(
            cfg,
            nodes=tuple(
                _table(NodeGroup, f"[[nodes]] #{i + 1}", n) for i, n in enumerate(data["nodes"])
            ),
        )
    return validate(cfg)


def load_cluster_toml(path: str | os.PathLike[str], base: UpConfig) -> UpConfig:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise UpConfigError(f"{p}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise UpConfigError(f"{p}: {e}") from None
    try:
        return parse_cluster_toml(data, base)
    except UpConfigError as e:
        raise UpConfigError(f"{p}: {e}") from None


def validate(cfg: UpConfig) -> UpConfig:
    if not cfg.nodes:
        raise UpConfigError("no nodes: give at least one decode (or colocated) node")
    for g in cfg.nodes:
        if g.role not in ROLES:
            raise UpConfigError(f"node role must be one of {', '.join(ROLES)}, got {g.role!r}")
        if not isinstance(g.count, int) or g.count < 1:
            raise UpConfigError(f"a {g.role} group needs count >= 1, got {g.count!r}")
        if g.pool not in POOLS:
            raise UpConfigError(f"node pool must be one of {', '.join(POOLS)}, got {g.pool!r}")
        if g.threads is not None and g.threads < 1:
            raise UpConfigError("threads must be >= 1")
        if g.pooling not in POOLINGS or (g.pooling != "last" and g.role != "embed"):
            raise UpConfigError(
                f'pooling is last or mean, and only for role = "embed" groups; got {g.pooling!r}'
            )
    for model in cfg.generation_models():
        if not any(
            g.role in ("decode", "both") and (g.model or cfg.model) == model for g in cfg.nodes
        ):
            raise UpConfigError(
                f"model {model!r} has no decode or colocated node: nothing would answer it"
            )
    if not 1 <= cfg.gateway.port <= 65535:
        raise UpConfigError(f"gateway port {cfg.gateway.port} is not a TCP port")
    if cfg.gateway.routing not in ("coordinator", "static"):
        raise UpConfigError(
            f"[gateway] routing must be 'coordinator' or 'static', got {cfg.gateway.routing!r}"
        )
    if cfg.coordinator.replicas < 1:
        raise UpConfigError("[coordinator] replicas must be >= 1")
    m = cfg.etcd.members
    if not isinstance(m, int) or isinstance(m, bool) or m < 1 or m % 2 == 0:
        raise UpConfigError(
            f"[etcd] members must be 1 or an odd number (3, 5: a quorum survives a loss), got {m!r}"
        )
    c = cfg.gateway.count
    if c is not None and (not isinstance(c, int) or isinstance(c, bool) or c < 1):
        raise UpConfigError(f"--gateways must be at least 1, got {c!r} ([gateway] count)")
    r = cfg.restart
    for name in (
        "max_restarts",
        "backoff_s",
        "backoff_max_s",
        "stable_s",
        "startup_timeout_s",
        "liveness_timeout_s",
        "gateway_liveness_timeout_s",
    ):
        v = getattr(r, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise UpConfigError(f"[restart] {name} must be a number >= 0, got {v!r}")
    if not isinstance(r.max_restarts, int):
        raise UpConfigError(
            f"[restart] max_restarts must be a whole number, got {r.max_restarts!r}"
        )
    return cfg


def plan_cpus(n_nodes: int, cpus: list[int]) -> list[list[int] | None]:
    """An even, contiguous share of `cpus` per node when there is at least one CPU per node;
    otherwise no pinning (None): nodes sharing cores are better left to the OS scheduler."""
    if n_nodes == 0 or len(cpus) < n_nodes:
        return [None] * n_nodes
    share, extra = divmod(len(cpus), n_nodes)
    out: list[list[int] | None] = []
    i = 0
    for k in range(n_nodes):
        n = share + (1 if k < extra else 0)
        out.append(cpus[i : i + n])
        i += n
    return out


def cpu_list(cpus: list[int]) -> str:
    return ",".join(str(c) for c in cpus)
