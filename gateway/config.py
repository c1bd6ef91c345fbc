"""`gateway.toml`: what the gateway serves and how (read with stdlib `tomllib`).

Every section is optional except `[models.*]`; defaults are what a small deployment wants.
Unknown keys are refused (a typo in a price or a limit must not pass silently). Example:

    [server]
    port = 8000
    instance = "gateway-a"            # this gateway's own name (stable across restarts; unique)
    max_provider_calls = 256          # calls to external providers at once, all teams (0: no bound)
    request_timeout_s = 600           # a request's whole time at most: past it, a
                                      # `request_timeout` error and its slots free (0: no cap;
                                      # the batch runner's lines are not capped)
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
    tool_parser = "hermes"            # or "llama3_json" (default: from the chat template;
                                      # docs/tools.md)
    features = ["tools", "structured_outputs", "penalties", "logit_bias"]
                                      # what it serves (default: all; "vllm_structured_outputs"
                                      # too, which external models lack by default)
    closed_objects = true             # JSON-schema objects that omit additionalProperties allow
                                      # no other key (default; false: as written —
                                      # docs/structured-outputs.md)

    [models."smollm2:sql"]            # a LoRA adapter of smollm2 as a model (config_adapters.py)
    adapter_path = "/srv/loras/sql"   # its PEFT directory on the nodes; prices: its own or the
                                      # base's
    teams = ["analytics"]             # only these teams may use and see it (any model;
                                      # default: all)

    [models.llama]                    # one name over a weighted set of versions, each on its
    kind = "cluster"                  # own nodes (config_versions.py; docs/models.md)
    tokenizer = "/models/llama-v1"
    versions.v1 = { served_name = "llama-v1", weight = 95 }   # the name v1's nodes register
    versions.v2 = { served_name = "llama-v2", weight = 5 }    # a canary: 1 request in 20

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
    allow_paid_for_batch = true       # batch requests may fall back to / auto-route to external
                                      # models
    cache_group = "shared-prompts"    # share the prefix cache with the group's other teams, on
                                      # purpose (default: the team's own domain; no team sees
                                      # another's prefixes)
    interactive = false               # batch tier only: x-duet-tier/service_tier asking for
                                      # interactive get a 403, and the team's requests default
                                      # to batch
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

import os
import tomllib
from pathlib import Path
from typing import Any

from gateway.config_adapters import check_adapters, with_adapters
from gateway.config_checks import (
    build,
    check_models,
    check_quotas,
    check_routing,
    check_server,
    model,
    parse_batch,
    provider_table,
    teams,
)
from gateway.config_tables import (
    AUTO,
    AUTO_LABELS,
    PROVIDER_KEYS,
    AutoConfig,
    BatchSettings,
    ConfigError,
    GatewayConfig,
    ModelConfig,
    ModelKind,
    QuotaConfig,
    RoutingConfig,
    ServerConfig,
    StaticNodes,
    TeamPolicy,
    Tier,
    TierConfig,
)
from runtime.models import duet_home
from runtime.tracing import TracingConfig

__all__ = [
    "AUTO",
    "AUTO_LABELS",
    "PROVIDER_KEYS",
    "AutoConfig",
    "BatchSettings",
    "ConfigError",
    "GatewayConfig",
    "ModelConfig",
    "ModelKind",
    "QuotaConfig",
    "RoutingConfig",
    "ServerConfig",
    "StaticNodes",
    "TeamPolicy",
    "Tier",
    "TierConfig",
    "default_store_url",
    "load_config",
    "parse_config",
    "provider_table",
]


def default_store_url() -> str:
    return f"sqlite://{(duet_home() / 'gateway.db').resolve()}"


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
        models={n: model(n, m) for n, m in with_adapters(models).items()},
        store_url=store.get("url") or default_store_url(),
        server=build(ServerConfig, "server", data.get("server", {})),
        routing=build(RoutingConfig, "routing", data.get("routing", {})),
        tiers=build(TierConfig, "tiers", data.get("tiers", {})),
        quotas=build(QuotaConfig, "quotas", data.get("quotas", {})),
        auto=build(AutoConfig, "auto", data["auto"]) if "auto" in data else None,
        teams=teams(data.get("teams", {})),
        batch=parse_batch(data.get("batch", {})),
        tracing=build(TracingConfig, "tracing", data.get("tracing", {})),
    )
    check_server(cfg.server)
    check_routing(cfg)
    check_quotas(cfg)
    check_models(cfg)
    check_adapters(cfg)
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
