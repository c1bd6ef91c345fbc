"""Cluster membership contracts (DESIGN §4): what a node registers in etcd, and where.

A node writes one `NodeInfo` under `node_key(cluster, role, node_id)`, bound to its etcd lease
(TTL ≈ 10 s, kept alive), so a dead node disappears from the cluster on its own. Readers
(coordinator replicas, gateways routing on their own etcd view) watch `nodes_prefix(cluster)`.
Only slow-changing facts live here: load and KV events travel by pull from the node itself
(`GET /kv/events`), never through etcd.

Invariant: `url` is the only address anyone uses to reach the node; a client never supplies it.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

from protocol.latency_hist import LatencyHistogram

Role = Literal["prefill", "decode", "both"]


class NodeStatus(enum.StrEnum):
    """Whether routers may send a node new work (the wire values are these strings)."""

    ACTIVE = "active"
    #: finishing in-flight work; no new routes (drain, or SIGTERM's grace period)
    DRAINING = "draining"


class NodeTask(enum.StrEnum):
    """What a node computes: text generation (the P/D legs) or embeddings (`--task embed`).
    Routers never send one task's work to a node of the other."""

    GENERATE = "generate"
    EMBED = "embed"


#: etcd lease TTL of a node registration (seconds)
NODE_TTL_S = 10
DEFAULT_CLUSTER = "default"


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    role: Role
    #: base URL of the node's HTTP API, e.g. http://10.0.0.5:8200
    url: str
    model: str
    engine_id: str
    #: "native" (engine/) or "vllm"; nodes of different kinds never pair (layout hash differs)
    engine_kind: str = "native"
    block_size: int
    #: KVLayout.compat_hash: a P and a D pair only when these are equal
    kv_layout_hash: str
    kv_capacity_blocks: int
    max_model_len: int
    #: routing pool label: "shared" (default), "interactive" or "batch"
    pool: str = "shared"
    status: NodeStatus = NodeStatus.ACTIVE
    #: who owns the drain `status: draining` stands for: a planner's ("planner/<replica>"), which
    #: lapses — the node undoes it — when its owner stops renewing it; "" for an operator's or
    #: SIGTERM's, which never lapses
    drain_owner: str = ""
    #: unix time the node process started
    started_at: float
    #: weight quantization of the served model (None: the model's own dtype)
    quantization: str | None = None
    #: generation (P/D legs) or embeddings: routers filter on it
    task: NodeTask = NodeTask.GENERATE
    #: LoRA adapter slots (0: the node serves no adapters); which adapters are resident travels
    #: in its load frames (LoadFrame.lora_adapters)
    max_loras: int = 0


def kv_layouts_match(prefill_hash: str | None, decode_hash: str | None) -> bool:
    """Whether a decode node may pull a prefill node's KV blocks: their `kv_layout_hash`
    (KVLayout.compat_hash) are equal. The one pairing rule of the coordinator's policy and of
    the gateway's own routing. None is a node whose layout was never registered (a configured
    static list): it pairs as the operator listed it — D still refuses a mismatch in the
    transfer handshake, before any byte moves, but only after P did the prefill."""
    return prefill_hash is None or decode_hash is None or prefill_hash == decode_hash


def cluster_prefix(cluster: str) -> str:
    return f"/duet/{cluster}/"


def nodes_prefix(cluster: str) -> str:
    return f"/duet/{cluster}/nodes/"


def node_key(cluster: str, role: str, node_id: str) -> str:
    return f"/duet/{cluster}/nodes/{role}/{node_id}"


def leader_key(cluster: str) -> str:
    return f"/duet/{cluster}/coordinator/leader"


def coordinators_prefix(cluster: str) -> str:
    """Coordinator replicas register their URL here (bound to their lease) so gateways can
    find every replica from etcd alone."""
    return f"/duet/{cluster}/coordinators/"


# -- GET /cluster: one coordinator replica's view (duet status, operators) ---------------------
class LoadReport(msgspec.Struct, frozen=True, kw_only=True):
    """A node's last load frame, as the replica last received it."""

    waiting: int
    running: int
    kv_cache_usage_perc: float
    queued_prefill_tokens: int
    kv_blocks_free: int
    kv_blocks_total: int
    #: the node's measured TTFT / ITL P90 over its recent window, with the sample counts (0
    #: samples: not measured — an older node, or no request in the window)
    ttft_p90_s: float = 0.0
    ttft_samples: int = 0
    itl_p90_s: float = 0.0
    itl_samples: int = 0
    #: the same windows' distributions as the node sent them (protocol/latency_hist.py; None: an
    #: older node), which the planner merges over a pool: its P90 on `GET /planner` is the
    #: merged one, not a mean of these nodes' P90s
    ttft_hist: LatencyHistogram | None = None
    itl_hist: LatencyHistogram | None = None
    #: the node's resident LoRA adapters and whether it sleeps (None: not reported)
    lora_adapters: list[str] | None = None
    sleeping: bool | None = None


class PendingReport(msgspec.Struct, frozen=True, kw_only=True):
    """Routing decisions sent to a node that its load frames do not show yet."""

    seqs: int
    prefill_tokens: int
    blocks: int


class ClusterNode(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    role: Role
    url: str
    model: str
    pool: str
    status: NodeStatus
    engine_id: str
    #: routable now: active, its event stream connected, its load fresh
    ready: bool
    connected: bool
    #: seconds since the last load frame (None: none yet)
    load_age_s: float | None
    load: LoadReport | None
    pending: PendingReport
    indexed_blocks: int
    event_seq: int
    resyncs: int
    event_lag_s: float
    task: NodeTask = NodeTask.GENERATE
    #: of `indexed_blocks`, those in the node's host and disk spill tiers
    indexed_host_blocks: int = 0
    indexed_disk_blocks: int = 0


class TierTokens(msgspec.Struct, frozen=True, kw_only=True):
    """Prompt tokens whose KV was reused, by where it was."""

    pool: int = 0
    host: int = 0
    disk: int = 0
    peer: int = 0


class ModelReuse(msgspec.Struct, frozen=True, kw_only=True):
    """Why a model's hit rate is what it is: of the prompt tokens routed, the reuse that existed
    somewhere in the cluster (per the replica's index, since it started), the reuse its routes
    captured on the node computing each prompt, by where; and what the nodes' engines delivered,
    by where, of the prompt tokens they computed (their counters since they started)."""

    model: str
    prompt_tokens: int
    existed: int
    routed: TierTokens
    engine_prompt_tokens: int
    delivered: TierTokens


class ClusterReport(msgspec.Struct, frozen=True, kw_only=True):
    cluster: str
    replica_id: str
    #: replica id of the leader as this replica last saw it (None: unknown)
    leader: str | None
    is_leader: bool
    etcd_connected: bool
    index_blocks: int
    index_max_blocks: int
    nodes: list[ClusterNode]
    #: KV reuse per model (an older replica sends none)
    reuse: list[ModelReuse] = []
