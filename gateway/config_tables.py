"""The tables of gateway.toml: one frozen dataclass per section (`[server]`, `[routing]`,
`[tiers]`, `[quotas]`, `[auto]`, `[teams.*]`, `[batch]`, `[models.*]`) and their root,
`GatewayConfig`; gateway/config.py reads a file into them and gateway/config_checks.py says
what each may hold; gateway/config_features.py reads a model's `features` key.

Invariant: every value here is immutable once loaded; a default is written once, here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.config_versions import ModelVersion, RolloutPolicy
from runtime.plane import PlaneSecurity
from runtime.read_deadlines import ReadDeadlines
from runtime.tracing import TracingConfig

#: "cluster": generation on duet's nodes; "external": a provider's model; "embedding": served by
#: duet nodes started with `--task embed`, on `/v1/embeddings` only (gateway/api/embeddings.py)
ModelKind = Literal["cluster", "external", "embedding"]
Tier = Literal["interactive", "batch"]
AUTO = "auto"
AUTO_LABELS = ("simple", "medium", "hard")
#: keys of an external model's table that configure its provider
#: (gateway/backends/providers/config.py)
PROVIDER_KEYS = (
    "base_url",
    "api_key_env",
    "upstream_model",
    "retry",
    "breaker",
    "timeouts",
    "headers",
    "anthropic_version",
)


class ConfigError(ValueError):
    """gateway.toml is missing, malformed, or names something impossible."""


@dataclass(frozen=True)
class StaticNodes:
    """Node URLs for the static router (no coordinator): disaggregated pairs, or colocated."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    both: tuple[str, ...] = ()
    #: node URL → its KV layout hash (NodeInfo.kv_layout_hash), filled from etcd registrations;
    #: a URL without one (a configured list) pairs with any node (protocol.cluster.kv_layouts_match)
    kv_layouts: Mapping[str, str] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class ModelConfig:
    name: str
    kind: ModelKind = "cluster"
    #: registry name, HF directory or .gguf whose tokenizer + chat template the gateway uses
    tokenizer: str | None = None
    #: the model name the nodes and the coordinator know (default: `name`)
    served_name: str | None = None
    max_model_len: int | None = None
    block_size: int = 16
    #: max_tokens when the request gives none (capped by the context left)
    default_max_tokens: int = 256
    input_usd_per_mtok: float = 0.0
    output_usd_per_mtok: float = 0.0
    #: price of prompt tokens served from a prefix cache (default: the input price)
    cached_input_usd_per_mtok: float | None = None
    #: price of prompt tokens written to a cache the client asked for (Anthropic's
    #: `cache_control`; default: the input price)
    cache_write_usd_per_mtok: float | None = None
    static: StaticNodes | None = None
    #: `model: "auto"` picks the cheapest model whose rank meets the prompt's needs (1..3)
    capability_rank: int = 1
    #: tiers whose requests this model takes (auto and fallback skip it for the others)
    tiers: tuple[Tier, ...] = ("interactive", "batch")
    #: models tried, in order, when this one cannot answer (see the module docstring)
    fallback: tuple[str, ...] = ()
    #: external models: "openai" (any OpenAI-compatible API) or "anthropic"
    provider: str | None = None
    #: external models: the PROVIDER_KEYS settings, checked by the providers package
    provider_options: dict[str, Any] = field(default_factory=dict)
    #: cluster models: how the model writes tool calls ("hermes" | "llama3_json"; default:
    #: detected from its chat template, else hermes with duet's generic tool prompt)
    tool_parser: str | None = None
    #: the optional API features it serves (gateway/serving/features.py; default: all of them)
    features: tuple[str, ...] | None = None
    #: a LoRA adapter served as a model (gateway/config_adapters.py): the base model's table,
    #: the adapter's name on the nodes, and its directory there (the coordinator loads it)
    base: str | None = None
    adapter: str | None = None
    adapter_path: str | None = None
    #: the only teams that may use and see this model (None: every team); others get a 404
    teams: tuple[str, ...] | None = None
    #: its weighted set of versions (gateway/config_versions.py; (): one, `cluster_name`)
    versions: tuple[ModelVersion, ...] = ()
    #: how `duet rollout start` moves its requests to a new version (None: the defaults)
    rollout: RolloutPolicy | None = None
    #: guides close a schema's objects that omit `additionalProperties` (text/json_closed.py);
    #: false: as written. A request's `disable_additional_properties` overrides it
    closed_objects: bool = True

    @property
    def cluster_name(self) -> str:
        return self.served_name or self.name


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    #: request bodies above this get a 413
    max_body_bytes: int = 4 * 2**20
    #: a request line or one header above this gets a 400 from the HTTP parser
    max_header_bytes: int = 16 * 1024
    #: an idle keep-alive connection (nothing sent since its last answer) is closed after this long
    keepalive_timeout_s: float = 75.0
    #: a request's headers must be complete this long after its first byte (a new connection's
    #: first request: after connecting), or the connection is closed with a 408 (slowloris; 0: off)
    header_timeout_s: float = 30.0
    #: a request body must arrive within this long plus 1 s per `body_min_rate_bytes_s` bytes
    #: received, or the connection is closed with a 408 (a trickled body; 0: off)
    body_timeout_s: float = 30.0
    #: the average rate a body must keep past `body_timeout_s` (runtime/read_deadlines.py)
    body_min_rate_bytes_s: int = 4096
    #: a stream whose client takes nothing this long is closed as a disconnect (relay.py; 0: off)
    write_timeout_s: float = 60.0
    #: a request's whole time, from its arrival to its answer's last token: past it a stream
    #: ends with a `request_timeout` error event, a whole answer is a 504, the nodes' work is
    #: aborted and the slots it held are free (gateway/serving/wall_clock.py; 0: no cap). Its
    #: client cannot hold a tier slot or its team's `max_concurrent` longer, however slowly
    #: it reads. The batch runner's lines are not capped (no client holds their slots)
    request_timeout_s: float = 600.0
    #: open connections from one client address (IPv6: one /64) at most; more are closed at
    #: once (0: no cap).
    #: Behind a load balancer or proxy every client shares its address: raise this there.
    max_connections_per_address: int = 1024
    #: calls to external providers (all external models, all teams) running at once on this
    #: gateway at most; one more is a 503 with Retry-After (gateway/backends/provider_slots.py; 0:
    #: no bound)
    max_provider_calls: int = 256
    #: sha256 hex of the admin key (or set $DUET_ADMIN_KEY to the key itself)
    admin_key_sha256: str | None = None
    #: seconds a found API key is trusted without asking the store again: a key revoked
    #: through another gateway or the CLI stops working within this time (through this
    #: gateway: at once); 0 asks the store on every request
    key_cache_ttl_s: float = 5.0
    #: load balancers (addresses or networks) whose X-Forwarded-For names the client that
    #: failed authentications count against (docs/security.md); any other peer's is ignored
    trusted_proxies: tuple[str, ...] = ()
    #: console cookies always `Secure` (else: over HTTPS, or a trusted proxy's X-Forwarded-Proto)
    secure_cookies: bool = False
    #: a structured-output constraint (response_format, guided_*, structured_outputs, a forced
    #: tool choice's schema) whose grammar compiles longer than this is a 400 "too complex"
    #: (text/guide_compile.py); compiles run off the event loop on at most
    #: `guide_compile_threads` threads at once
    guide_compile_timeout_s: float = 5.0
    guide_compile_threads: int = 2
    #: console requests (pages, live refreshes, forms) one signed-in session makes a minute at
    #: most, and fewer when its team's `rpm` is lower (gateway/console/limits.py); 0: no cap
    console_rpm: int = 120
    #: listen on `port` with SO_REUSEPORT, so several gateway processes (on one store) share
    #: it and the kernel spreads connections over them (`duet up --gateways N`; Linux)
    reuse_port: bool = False
    #: this process's own port on 127.0.0.1 besides `port` (same app): its health check and
    #: metrics, which the shared port answers from whichever gateway the kernel picked
    instance_port: int | None = None
    #: this gateway's name among the processes sharing the store, stable across its restarts
    #: (`duet up`: "gateway", "gateway-0", …): a restarted gateway reclaims — bills and frees —
    #: its dead life's reservations as it starts, instead of after 2.5 missed heartbeats. Two
    #: live gateways must never share one (each would reclaim the other's bookings).
    instance: str | None = None

    def read_deadlines(self) -> ReadDeadlines:
        return ReadDeadlines(
            header_timeout_s=self.header_timeout_s,
            body_timeout_s=self.body_timeout_s,
            body_min_rate_bytes_s=self.body_min_rate_bytes_s,
        )


@dataclass(frozen=True)
class RoutingConfig:
    coordinator: tuple[str, ...] = ()
    #: etcd endpoint ("http://host:port"): find coordinators and nodes without a list
    etcd: str | None = None
    cluster: str = "default"
    route_timeout_s: float = 2.0
    connect_timeout_s: float = 3.0
    #: the whole prefill leg
    prefill_timeout_s: float = 120.0
    #: longest silence on a decode stream before its first token (a queue, a long prompt)
    read_timeout_s: float = 120.0
    #: longest silence on a decode stream once its tokens flow: past it the node is taken for
    #: frozen (a grey failure: sockets open, nothing streams) and the stream migrates
    stall_timeout_s: float = 10.0
    #: a node this gateway could not reach (connect or acknowledgement past connect_timeout_s, a
    #: stalled stream) is left out of its routing this long, even while etcd still lists it
    unreachable_exclude_s: float = 10.0
    #: route + prefill + decode tries before the request fails
    max_attempts: int = 3
    #: times a stream whose decode node died after its first token moves to another node
    #: (stream migration; 0: never, the client gets an SSE error event)
    max_migrations: int = 2
    #: no migration starts once the request has run this long (seconds): a bound on the
    #: request's whole time, however many nodes die under it
    migration_deadline_s: float = 300.0
    #: open connections to one node (or coordinator, or provider) at most; more requests wait
    #: for one (bounded by read_timeout_s) instead of flooding it: a node runs a few hundred
    #: at once and queues or refuses the rest anyway, and every socket is a descriptor here
    max_connections_per_node: int = 1024


@dataclass(frozen=True)
class TierConfig:
    #: requests this gateway runs at once on the cluster; beyond, they queue by tier
    max_inflight: int = 256
    interactive_queue: int = 512
    batch_queue: int = 128
    interactive_max_wait_s: float = 30.0
    batch_max_wait_s: float = 10.0
    #: an interactive request for a model with a usable fallback waits at most this long for
    #: a slot, then goes to the fallback model (trigger "saturated") instead of queueing on
    interactive_fallback_wait_s: float = 1.0
    default_tier: Tier = "interactive"
    #: what one output token counts for against one prompt token in a team's attained service
    #: (the fair order of a saturated tier's queue; a decode step costs more than a prompt
    #: token's share of prefill)
    fair_output_weight: float = 2.0
    #: false: a saturated tier serves its waiters first come first served, whatever their team
    #: (the order before fair shares; kept for comparing the two)
    fair_share: bool = True
    #: slots kept free of a team beyond its fair share while another active team holds less
    #: than its own, so that team's next request starts at once instead of waiting for a slot
    #: to free (gateway/serving/headroom.py); unset: 1 from 8 slots, 2 from 64 (a flood keeps
    #: 31 of 32 slots' worth where another team is active); 0: none
    fair_headroom: int | None = None
    #: a team that asked for a slot within this many seconds (or waits for one) is active: it
    #: counts in the shares, and its room under its share is held for it
    fair_active_s: float = 5.0
    #: a stream is read from its node ahead of a slow client up to this many bytes, its slot
    #: given back once the node is done (gateway/serving/read_ahead.py; 0: off)
    stream_read_ahead_bytes: int = 256 * 1024

    @property
    def headroom(self) -> int:
        """The slots held by `fair_headroom`, its default applied (none without fair shares)."""
        if not self.fair_share:
            return 0
        if self.fair_headroom is None:
            return 0 if self.max_inflight < 8 else min(2, max(1, self.max_inflight // 32))
        return self.fair_headroom


@dataclass(frozen=True)
class QuotaConfig:
    #: an unsettled reservation older than this is expired (its request's process died) —
    #: renewed by its gateway's heartbeat while that gateway lives
    reservation_ttl_s: float = 900.0
    #: each gateway's heartbeat in the store (it reports what each stream has sent); a gateway
    #: silent for 2.5 heartbeats is dead and its reservations are reclaimed by any live gateway,
    #: billed at their prompt plus the tokens streamed as of its last heartbeat
    heartbeat_s: float = 5.0
    #: usage records per store transaction (the batched writer)
    usage_batch: int = 256
    #: requests in flight at once for a team whose own `max_concurrent` is unset (across
    #: gateways sharing the store); 0: no default bound
    default_max_concurrent: int = 64


@dataclass(frozen=True)
class AutoConfig:
    """`model: "auto"`; served only when the `[auto]` section is present."""

    #: the models auto may choose (default: every model)
    models: tuple[str, ...] = ()
    #: classifier label → capability rank it needs
    rank_for: dict[str, int] = field(default_factory=lambda: {"simple": 1, "medium": 2, "hard": 3})


@dataclass(frozen=True)
class TeamPolicy:
    """How the gateway chooses models for one team (`[teams.<id>]`; `[teams."*"]` for the rest)."""

    #: classifier label → the model `auto` uses for it (when that model can take the request)
    auto_pin: dict[str, str] = field(default_factory=dict)
    #: models never chosen for this team: not by auto, not as a fallback, and a 403 by name
    forbid: tuple[str, ...] = ()
    #: batch requests may reach paid (external) models by fallback or auto
    allow_paid_for_batch: bool = False
    #: prefix-cache domain shared on purpose with the other teams of this group (e.g. a common
    #: system prompt); None: the team's own domain, matched by no other team (`cache_domain`)
    cache_group: str | None = None
    #: may use the interactive tier; False: batch only (an explicit ask for interactive is a
    #: 403, the team's default tier becomes batch) — the tier is the operator's grant, not
    #: the client's choice
    interactive: bool = True
    #: the highest `priority` its batches may ask for ("low" | "normal" | "high"); above it: 403
    batch_priority: str = "normal"
    #: the team's share of a saturated tier against the other waiting teams' (tokens served in
    #: proportion to it; gateway/serving/fair_queue.py)
    weight: float = 1.0


@dataclass(frozen=True, kw_only=True)
class BatchLimits:
    """The batch tier's bounds and pace: the keys `[batch]` and the runner's `BatchConfig`
    (gateway/batch/config.py) share, written once here (defaults follow OpenAI's Batch API)."""

    #: batch requests a runner has in flight at once (each also takes an admission slot)
    concurrency: int = 4
    #: a claim not renewed for this long is taken over by another (or a restarted) gateway
    lease_s: float = 60.0
    #: how often an idle runner looks for work
    poll_s: float = 0.5
    #: runs of one line before its last answer is final
    max_attempts: int = 5
    retry_base_s: float = 1.0
    max_requests: int = 50_000
    max_file_bytes: int = 200 * 2**20
    #: one request line at most (OpenAI's per-request body bound is far below a file's)
    max_line_bytes: int = 2**20
    #: batches of one team not yet ended (validating, in_progress, finalizing, cancelling)
    max_open_batches: int = 100
    #: bytes of one team's stored files (inputs and results) not deleted, and of the request
    #: bodies its batches hold until they end
    max_team_bytes: int = 10 * 2**30
    #: uploads and batch creations in progress at once (each reads a whole file), in all and
    #: per team; one more is refused with 429
    max_uploads: int = 8
    max_team_uploads: int = 2
    #: batch API calls (files, batches, the simple form) per team per minute on one gateway;
    #: one more is refused with 429 and Retry-After (0: no bound)
    max_api_calls_per_minute: int = 6000
    #: HMAC secret for callbacks (or $DUET_BATCH_CALLBACK_SECRET); per-team overrides below; no
    #: secret: no callbacks
    callback_secret: str | None = None
    callback_secrets: dict[str, str] = field(default_factory=dict)
    #: callbacks to loopback/private addresses (labs, tests); refused by default
    allow_private_callbacks: bool = False


@dataclass(frozen=True, kw_only=True)
class BatchSettings(BatchLimits):
    """`[batch]`: the Files/Batches API and its runner (gateway/batch/wiring.py)."""

    enabled: bool = True
    #: fraction off the model's prices for batch lines (0.5 = half price)
    discount: float = 0.5
    #: the batch tables' SQLite file and the file contents; default: a `batch` directory next
    #: to the SQLite gateway store, else $DUET_HOME/batch (several gateways must share one:
    #: see gateway/batch/wiring.py)
    data_dir: str | None = None
    #: unique among live gateways sharing a store, stable across restarts (default: host:port)
    worker_id: str | None = None


@dataclass(frozen=True)
class GatewayConfig:
    models: dict[str, ModelConfig]
    store_url: str = ""
    #: OpenTelemetry ([tracing]: enabled, endpoint, ring_size, sample_ratio; runtime/tracing/)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    tiers: TierConfig = TierConfig()
    quotas: QuotaConfig = QuotaConfig()
    auto: AutoConfig | None = None
    teams: dict[str, TeamPolicy] = field(default_factory=dict)
    batch: BatchSettings = BatchSettings()
    #: cluster secret, TLS and /metrics policy (flags of `duet gateway`; runtime/plane.py)
    #: /metrics protected by default: its series carry team labels (`--open-metrics` opens it)
    security: PlaneSecurity = field(default_factory=lambda: PlaneSecurity(protect_metrics=True))

    def team_policy(self, team_id: str) -> TeamPolicy:
        return self.teams.get(team_id) or self.teams.get("*") or TeamPolicy()

    def cache_domain(self, team_id: str) -> str:
        """The team's prefix-cache domain (DESIGN §8): its `cache_group`, else the team itself.
        The prefixes keep groups and teams apart even when a group is named like a team."""
        group = self.team_policy(team_id).cache_group
        return f"group:{group}" if group else f"team:{team_id}"

    @property
    def admin_key(self) -> str | None:
        return os.environ.get("DUET_ADMIN_KEY") or None
