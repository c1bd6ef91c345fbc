"""`gateway.toml`: what the gateway serves and how (read with stdlib `tomllib`).

Every section is optional except `[models.*]`; defaults are what a small deployment wants.
Unknown keys are refused (a typo in a price or a limit must not pass silently). Example:

    [server]
    port = 8000
    instance = "gateway-a"            # this gateway's own name (stable across restarts; unique)
    max_provider_calls = 256          # calls to external providers at once, all teams (0: no bound)
    guide_compile_timeout_s = 5.0     # a constraint's grammar compiling longer is a 400 (2 threads
                                      # compile, off the event loop: docs/structured-outputs.md)

    [store]
    url = "sqlite:///var/lib/duet/gateway.db"   # default: sqlite:///$DUET_HOME/gateway.db

    [routing]
    coordinator = ["http://10.0.0.2:8400", "http://10.0.0.3:8400"]   # every replica
    etcd = "http://10.0.0.2:2379"     # optional: find replicas and nodes there too
    max_migrations = 2                # a stream whose decode node dies moves on at most twice

    [batch]                           # Files/Batches API (on by default)
    concurrency = 4
    discount = 0.5                    # batch lines cost half the model's price

    [models.smollm2]
    kind = "cluster"                  # served by duet nodes; "external" is a provider's model
    tokenizer = "smollm2-135m-instruct"
    input_usd_per_mtok = 0.10
    output_usd_per_mtok = 0.20
    static = { prefill = ["http://p1:8100"], decode = ["http://d1:8200"] }
    capability_rank = 1               # for `model: "auto"` (higher = more capable)
    fallback = ["gpt-4o-mini"]        # tried in order when this model cannot answer
    tool_parser = "hermes"            # or "llama3_json" (default: from the chat template; docs/tools.md)
    features = ["tools", "structured_outputs", "penalties", "logit_bias"]   # what it serves (default: all;
                                      # "vllm_structured_outputs" too, which external models lack by default)

    [models.embed]                    # POST /v1/embeddings on `duet node --task embed` nodes
    kind = "embedding"                # (docs/embeddings.md); chat/completions on it get a 400
    tokenizer = "smollm2-135m-instruct"
    input_usd_per_mtok = 0.02

    [models.gpt-4o-mini]
    kind = "external"
    provider = "openai"               # or "anthropic"
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"    # the key itself never sits in this file
    upstream_model = "gpt-4o-mini-2024-07-18"   # the provider's name, if not the table's
    input_usd_per_mtok = 0.15
    output_usd_per_mtok = 0.60
    max_model_len = 128000            # its context length (required for external models)
    tiers = ["interactive", "batch"]  # tiers it serves (default: both)
    capability_rank = 2
    breaker = { failure_threshold = 5, cooldown_s = 30.0 }   # also: retry, timeouts, headers

    [auto]                            # serve `model: "auto"` (absent: no auto)
    models = ["smollm2", "gpt-4o-mini"]   # candidates (default: every model)

    [teams.ml]                        # routing policy of team `ml` (its limits live in the store)
    auto_pin = { hard = "gpt-4o-mini" }   # label (simple|medium|hard) → model auto uses
    forbid = ["claude-sonnet"]        # never chosen for this team: by auto, by fallback, or by name
    allow_paid_for_batch = true       # batch requests may fall back to / auto-route to external models
    cache_group = "shared-prompts"    # share the prefix cache with the group's other teams, on purpose
                                      # (default: the team's own domain; no team sees another's prefixes)
    interactive = false               # batch tier only: x-duet-tier/service_tier asking for interactive
                                      # get a 403, and the team's requests default to batch
    batch_priority = "high"           # the highest batch priority it may ask for (default "normal")
    [teams."*"]                       # the policy of every team not listed

    [tracing]                         # OpenTelemetry (off by default; also DUET_TRACING=1, --trace)
    enabled = true
    endpoint = "http://jaeger:4318"   # OTLP/HTTP (default: $OTEL_EXPORTER_OTLP_ENDPOINT, else none)
    ring_size = 20000                 # spans kept in memory for the console's request view

Fallback triggers: the self-hosted pool saturated (an interactive request waited
`[tiers] interactive_fallback_wait_s` for a slot), no healthy node, an open circuit breaker, a
provider's 5xx/429 after its retries. Batch requests never reach a paid (external) model unless
their team's `allow_paid_for_batch` says so.

Invariant: a `GatewayConfig` is immutable once loaded; the CLI's flags override the file.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from gateway.features import parse_features
from gateway.tools.formats import TOOL_PARSERS
from runtime.models import duet_home
from runtime.plane import PlaneSecurity
from runtime.read_deadlines import ReadDeadlines
from runtime.tables import from_table
from runtime.tracing import TracingConfig

#: "cluster": generation on duet's nodes; "external": a provider's model; "embedding": served by
#: duet nodes started with `--task embed`, on `/v1/embeddings` only (gateway/embeddings.py)
ModelKind = Literal["cluster", "external", "embedding"]
Tier = Literal["interactive", "batch"]
AUTO = "auto"
AUTO_LABELS = ("simple", "medium", "hard")
#: keys of an external model's table that configure its provider (gateway/providers/config.py)
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
    #: the optional API features it serves (gateway/features.py; default: all of them)
    features: tuple[str, ...] | None = None

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
    #: open connections from one client address at most; more are closed at once (0: no cap).
    #: Behind a load balancer or proxy every client shares its address: raise this there.
    max_connections_per_address: int = 1024
    #: calls to external providers (all external models, all teams) running at once on this
    #: gateway at most; one more is a 503 with Retry-After (gateway/provider_slots.py; 0: no bound)
    max_provider_calls: int = 256
    #: sha256 hex of the admin key (or set $DUET_ADMIN_KEY to the key itself)
    admin_key_sha256: str | None = None
    #: seconds a found API key is trusted without asking the store again: a key revoked
    #: through another gateway or the CLI stops working within this time (through this
    #: gateway: at once); 0 asks the store on every request
    key_cache_ttl_s: float = 5.0
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
    #: longest silence on a decode stream (first token included)
    read_timeout_s: float = 120.0
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
    default_max_concurrent: int = 128


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


@dataclass(frozen=True)
class BatchSettings:
    """`[batch]`: the Files/Batches API and its runner (gateway/batch_wiring.py)."""

    enabled: bool = True
    #: batch requests this gateway runs at once (each also takes an admission slot)
    concurrency: int = 4
    #: fraction off the model's prices for batch lines (0.5 = half price)
    discount: float = 0.5
    #: batch store + file contents; default: a `batch` directory next to the SQLite gateway
    #: store, else $DUET_HOME/batch (several gateways must share one: see batch_wiring.py)
    data_dir: str | None = None
    #: HMAC secret for callbacks (or $DUET_BATCH_CALLBACK_SECRET); per-team overrides below
    callback_secret: str | None = None
    callback_secrets: dict[str, str] = field(default_factory=dict)
    #: callbacks to loopback/private addresses (labs, tests); refused by default
    allow_private_callbacks: bool = False
    #: a claim not renewed for this long is taken over by another (or a restarted) gateway
    lease_s: float = 60.0
    poll_s: float = 0.5
    #: runs of one line before its last answer is final
    max_attempts: int = 5
    retry_base_s: float = 1.0
    #: unique among live gateways sharing a store, stable across restarts (default: host:port)
    worker_id: str | None = None
    max_requests: int = 50_000
    max_file_bytes: int = 200 * 2**20
    #: one request line at most (OpenAI's per-request body bound is far below a file's)
    max_line_bytes: int = 2**20
    #: batches of one team not yet ended (validating, in_progress, finalizing, cancelling)
    max_open_batches: int = 100
    #: bytes of one team's stored files (inputs and results) not deleted
    max_team_bytes: int = 10 * 2**30


@dataclass(frozen=True)
class GatewayConfig:
    models: dict[str, ModelConfig]
    store_url: str = ""
    #: OpenTelemetry ([tracing]: enabled, endpoint, ring_size, sample_ratio; runtime/tracing.py)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    tiers: TierConfig = TierConfig()
    quotas: QuotaConfig = QuotaConfig()
    auto: AutoConfig | None = None
    teams: dict[str, TeamPolicy] = field(default_factory=dict)
    batch: BatchSettings = BatchSettings()
    #: cluster secret, TLS and /metrics policy (flags of `duet gateway`; runtime/plane.py)
    security: PlaneSecurity = field(default_factory=PlaneSecurity)

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


def default_store_url() -> str:
    return f"sqlite://{(duet_home() / 'gateway.db').resolve()}"


def _build(cls: type, section: str, data: Any) -> Any:
    return from_table(cls, data, f"[{section}]", ConfigError)


def _model(name: str, data: Any) -> ModelConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"[models.{name}] must be a table")
    if name == AUTO or "/" in name:
        raise ConfigError(
            f"[models.{name}] is not a usable model name ('{AUTO}' is reserved, '/' is refused)"
        )
    data = dict(data)
    static = data.pop("static", None)
    options = {k: data.pop(k) for k in PROVIDER_KEYS if k in data}
    if "provider_options" in data:
        raise ConfigError(f"[models.{name}] has unknown keys: provider_options")
    m = _build(ModelConfig, f"models.{name}", {**data, "name": name, "provider_options": options})
    if static is not None:
        m = ModelConfig(
            **{**m.__dict__, "static": _build(StaticNodes, f"models.{name}.static", static)}
        )
    if m.kind not in ("cluster", "external", "embedding"):
        raise ConfigError(
            f"[models.{name}] kind must be 'cluster', 'external' or 'embedding', got {m.kind!r}"
        )
    if m.kind in ("cluster", "embedding") and not m.tokenizer:
        raise ConfigError(
            f"[models.{name}] a {m.kind} model needs `tokenizer` (registry name or directory)"
        )
    if m.kind == "embedding" and (m.fallback or m.output_usd_per_mtok):
        raise ConfigError(f"[models.{name}] an embedding model has no fallback and no output price")
    if m.kind in ("cluster", "embedding") and (m.provider or options):
        raise ConfigError(
            f"[models.{name}] provider settings ({', '.join(['provider', *options])}) are for "
            'kind = "external" models'
        )
    for k in ("input_usd_per_mtok", "output_usd_per_mtok", "cached_input_usd_per_mtok"):
        v = getattr(m, k)
        # NaN passes every comparison (a budget check against a NaN cost admits everything)
        if v is not None and (not isinstance(v, int | float) or not math.isfinite(v) or v < 0):
            raise ConfigError(f"[models.{name}] {k} must be a finite number >= 0, got {v!r}")
    if not isinstance(m.capability_rank, int) or m.capability_rank < 1:
        raise ConfigError(f"[models.{name}] capability_rank must be an integer >= 1")
    if not m.tiers or any(t not in ("interactive", "batch") for t in m.tiers):
        raise ConfigError(f"[models.{name}] tiers must list 'interactive' and/or 'batch'")
    if m.tool_parser is not None and m.tool_parser not in TOOL_PARSERS:
        raise ConfigError(
            f"[models.{name}] tool_parser must be one of {', '.join(TOOL_PARSERS)}, "
            f"got {m.tool_parser!r}"
        )
    if m.features is not None:
        try:
            m = replace(m, features=parse_features(m.features, f"[models.{name}]"))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if m.kind == "external":
        if m.provider not in ("openai", "anthropic"):
            raise ConfigError(
                f'[models.{name}] an external model needs provider = "openai" or "anthropic"'
            )
        if not m.max_model_len:
            raise ConfigError(
                f"[models.{name}] an external model needs max_model_len (its context length)"
            )
    return m


def provider_table(m: ModelConfig) -> dict[str, Any]:
    """An external model's settings as a providers `ProviderConfig` table."""
    o = dict(m.provider_options)
    if "upstream_model" in o:
        o["model"] = o.pop("upstream_model")
    t = {
        "name": m.name,
        "kind": m.provider,
        "input_price_per_m": m.input_usd_per_mtok,
        "output_price_per_m": m.output_usd_per_mtok,
        "context_length": m.max_model_len,
        "capability_rank": m.capability_rank,
        "tiers": list(m.tiers),
        **o,
    }
    if m.cached_input_usd_per_mtok is not None:
        t["cached_input_price_per_m"] = m.cached_input_usd_per_mtok
    return t


def _check_provider(m: ModelConfig) -> None:
    from gateway.providers.config import ConfigError as ProviderConfigError
    from gateway.providers.config import ProviderConfig

    try:
        ProviderConfig.from_dict(provider_table(m))
    except ProviderConfigError as e:
        raise ConfigError(f"[models.{m.name}] {e}") from None


def _names(section: str, key: str, value: Any, models: dict[str, ModelConfig]) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"[{section}] {key} must be a list of model names")
    unknown = [v for v in value if v not in models]
    if unknown:
        raise ConfigError(
            f"[{section}] {key} names unknown models: {', '.join(unknown)} "
            f"(known: {', '.join(sorted(models))})"
        )
    if len(set(value)) != len(value):
        raise ConfigError(f"[{section}] {key} names a model twice: {list(value)}")
    return tuple(value)


def _check_routing(cfg: GatewayConfig) -> None:
    embedding = {n for n, m in cfg.models.items() if m.kind == "embedding"}
    for m in cfg.models.values():
        if m.kind == "external":
            _check_provider(m)
        chain = _names(f"models.{m.name}", "fallback", m.fallback, cfg.models)
        if m.name in chain:
            raise ConfigError(f"[models.{m.name}] fallback names the model itself")
        if embedding & set(chain):
            raise ConfigError(
                f"[models.{m.name}] fallback names an embedding model: {', '.join(sorted(embedding & set(chain)))}"
            )
    if cfg.auto is not None:
        _names("auto", "models", cfg.auto.models, cfg.models)
        if embedding & set(cfg.auto.models):
            raise ConfigError(
                f"[auto] models names an embedding model: {', '.join(sorted(embedding & set(cfg.auto.models)))}"
            )
        if set(cfg.auto.rank_for) != set(AUTO_LABELS) or not all(
            isinstance(v, int) and v >= 1 for v in cfg.auto.rank_for.values()
        ):
            raise ConfigError(
                f"[auto] rank_for must give a rank >= 1 to each of {', '.join(AUTO_LABELS)}"
            )
    for team, p in cfg.teams.items():
        _names(f"teams.{team}", "forbid", p.forbid, cfg.models)
        if not isinstance(p.auto_pin, dict) or set(p.auto_pin) - set(AUTO_LABELS):
            raise ConfigError(
                f"[teams.{team}] auto_pin maps labels ({', '.join(AUTO_LABELS)}) to models"
            )
        _names(f"teams.{team}", "auto_pin", list(p.auto_pin.values()), cfg.models)
        if not isinstance(p.allow_paid_for_batch, bool):
            raise ConfigError(f"[teams.{team}] allow_paid_for_batch must be true or false")
        if p.cache_group is not None and (
            not isinstance(p.cache_group, str) or not 0 < len(p.cache_group) <= 200
        ):
            raise ConfigError(f"[teams.{team}] cache_group must be a name of 1 to 200 characters")
        if not isinstance(p.interactive, bool):
            raise ConfigError(f"[teams.{team}] interactive must be true or false")
        if p.batch_priority not in ("low", "normal", "high"):
            raise ConfigError(f"[teams.{team}] batch_priority must be 'low', 'normal' or 'high'")


def _teams(data: Any) -> dict[str, TeamPolicy]:
    if not isinstance(data, dict):
        raise ConfigError("[teams] must be a table of [teams.<team id>] tables")
    return {t: _build(TeamPolicy, f"teams.{t}", p) for t, p in data.items()}


def _batch(data: Any) -> BatchSettings:
    b = _build(BatchSettings, "batch", data)
    if not 0.0 <= b.discount <= 1.0:
        raise ConfigError(
            f"[batch] discount is the fraction off the price, in [0, 1]; got {b.discount}"
        )
    if b.concurrency < 0 or b.max_attempts < 1 or b.lease_s <= 0 or b.poll_s <= 0:
        raise ConfigError(
            "[batch] concurrency must be >= 0, max_attempts >= 1, lease_s and poll_s > 0"
        )
    if not isinstance(b.callback_secrets, dict) or not all(
        isinstance(v, str) for v in b.callback_secrets.values()
    ):
        raise ConfigError("[batch] callback_secrets is a table of team id = secret")
    for k in (
        "max_line_bytes",
        "max_open_batches",
        "max_team_bytes",
        "max_requests",
        "max_file_bytes",
    ):
        v = getattr(b, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"[batch] {k} must be an integer >= 1, got {v!r}")
    return b


def parse_config(data: dict[str, Any]) -> GatewayConfig:
    known = {
        "models",
        "store",
        "server",
        "routing",
        "tiers",
        "quotas",
        "auto",
        "teams",
        "batch",
        "tracing",
    }
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"unknown sections: {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    models = data.get("models") or {}
    if not models:
        raise ConfigError("no [models.NAME] section: the gateway must serve at least one model")
    store = data.get("store", {})
    if set(store) - {"url"}:
        raise ConfigError("[store] takes only `url`")
    cfg = GatewayConfig(
        models={n: _model(n, m) for n, m in models.items()},
        store_url=store.get("url") or default_store_url(),
        server=_build(ServerConfig, "server", data.get("server", {})),
        routing=_build(RoutingConfig, "routing", data.get("routing", {})),
        tiers=_build(TierConfig, "tiers", data.get("tiers", {})),
        quotas=_build(QuotaConfig, "quotas", data.get("quotas", {})),
        auto=_build(AutoConfig, "auto", data["auto"]) if "auto" in data else None,
        teams=_teams(data.get("teams", {})),
        batch=_batch(data.get("batch", {})),
        tracing=_build(TracingConfig, "tracing", data.get("tracing", {})),
    )
    if (
        not isinstance(cfg.server.key_cache_ttl_s, (int, float))
        or isinstance(cfg.server.key_cache_ttl_s, bool)
        or not 0 <= cfg.server.key_cache_ttl_s <= 3600
    ):
        raise ConfigError(
            f"[server] key_cache_ttl_s must be a number of seconds in [0, 3600], got {cfg.server.key_cache_ttl_s!r}"
        )
    problem = cfg.server.read_deadlines().problem()
    if problem is not None:
        raise ConfigError(f"[server] {problem}")
    gt, gn = cfg.server.guide_compile_timeout_s, cfg.server.guide_compile_threads
    if not isinstance(gt, int | float) or isinstance(gt, bool) or not 0 < gt <= 600:
        raise ConfigError(
            f"[server] guide_compile_timeout_s must be a number of seconds in (0, 600], got {gt!r}"
        )
    if not isinstance(gn, int) or isinstance(gn, bool) or not 1 <= gn <= 64:
        raise ConfigError(
            f"[server] guide_compile_threads must be an integer in [1, 64], got {gn!r}"
        )
    if (
        not isinstance(cfg.server.console_rpm, int)
        or isinstance(cfg.server.console_rpm, bool)
        or cfg.server.console_rpm < 0
    ):
        raise ConfigError(
            f"[server] console_rpm must be an integer >= 0, got {cfg.server.console_rpm!r}"
        )
    mp = cfg.server.max_provider_calls
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 0:
        raise ConfigError(
            f"[server] max_provider_calls must be an integer >= 0 (0: no bound), got {mp!r}"
        )
    inst = cfg.server.instance
    if inst is not None and (
        not isinstance(inst, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", inst)
    ):
        raise ConfigError(
            f"[server] instance must be 1-64 letters, digits, '_', '.', '-', got {inst!r}"
        )
    if (
        not isinstance(cfg.routing.max_connections_per_node, int)
        or cfg.routing.max_connections_per_node < 1
    ):
        raise ConfigError("[routing] max_connections_per_node must be an integer >= 1")
    if (
        not isinstance(cfg.routing.max_migrations, int)
        or cfg.routing.max_migrations < 0
        or not cfg.routing.migration_deadline_s > 0
    ):
        raise ConfigError(
            "[routing] max_migrations must be an integer >= 0 and migration_deadline_s > 0"
        )
    if cfg.tiers.default_tier not in ("interactive", "batch"):
        raise ConfigError("[tiers] default_tier must be 'interactive' or 'batch'")
    q = cfg.quotas
    for name in ("reservation_ttl_s", "heartbeat_s"):
        v = getattr(q, name)
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"[quotas] {name} must be a positive number of seconds, got {v!r}")
    if (
        not isinstance(q.default_max_concurrent, int)
        or isinstance(q.default_max_concurrent, bool)
        or q.default_max_concurrent < 0
    ):
        raise ConfigError(
            f"[quotas] default_max_concurrent must be an integer >= 0, got {q.default_max_concurrent!r}"
        )
    if q.reservation_ttl_s < 3 * q.heartbeat_s:
        raise ConfigError(
            f"[quotas] reservation_ttl_s ({q.reservation_ttl_s}) must be at least 3 heartbeats "
            f"({3 * q.heartbeat_s}): a live gateway renews its reservations once a heartbeat"
        )
    _check_routing(cfg)
    return cfg


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: {e}") from None
    return parse_config(data)
