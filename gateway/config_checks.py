"""What each table of gateway.toml may hold: the checks `parse_config` runs, each refusing with
a `ConfigError` that names the section and the key (a typo in a price or a limit must not pass
silently)."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import replace
from typing import Any

from gateway.config_features import parse_features
from gateway.config_tables import (
    AUTO,
    AUTO_LABELS,
    PROVIDER_KEYS,
    BatchSettings,
    ConfigError,
    GatewayConfig,
    ModelConfig,
    ServerConfig,
    StaticNodes,
    TeamPolicy,
)
from gateway.config_versions import VersionError, parse_rollout, parse_versions
from gateway.tools.formats import TOOL_PARSERS
from runtime.tables import from_table


def build(cls: type, section: str, data: Any) -> Any:
    return from_table(cls, data, f"[{section}]", ConfigError)


def model(name: str, data: Any) -> ModelConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"[models.{name}] must be a table")
    if name == AUTO or "/" in name:
        raise ConfigError(
            f"[models.{name}] is not a usable model name ('{AUTO}' is reserved, '/' is refused)"
        )
    data = dict(data)
    static = data.pop("static", None)
    versions = data.pop("versions", None)
    rollout = data.pop("rollout", None)
    options = {k: data.pop(k) for k in PROVIDER_KEYS if k in data}
    if "provider_options" in data:
        raise ConfigError(f"[models.{name}] has unknown keys: provider_options")
    m = build(ModelConfig, f"models.{name}", {**data, "name": name, "provider_options": options})
    if static is not None:
        m = ModelConfig(
            **{**m.__dict__, "static": build(StaticNodes, f"models.{name}.static", static)}
        )
    if versions is not None:
        if m.kind != "cluster" or m.static is not None or m.served_name is not None:
            raise ConfigError(  # each version names its own served name
                f"[models.{name}] versions are for a cluster model without static node lists "
                "or served_name"
            )
        try:
            m = replace(m, versions=parse_versions(name, versions))
            if rollout is not None:
                m = replace(m, rollout=parse_rollout(name, rollout))
        except VersionError as e:
            raise ConfigError(str(e)) from None
    elif rollout is not None:
        raise ConfigError(f"[models.{name}] a rollout needs [models.{name}.versions]")
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
    for k in (
        "input_usd_per_mtok",
        "output_usd_per_mtok",
        "cached_input_usd_per_mtok",
        "cache_write_usd_per_mtok",
    ):
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
    if not isinstance(m.closed_objects, bool):
        raise ConfigError(f"[models.{name}] closed_objects must be true or false")
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
    if m.cache_write_usd_per_mtok is not None:
        t["cache_write_input_price_per_m"] = m.cache_write_usd_per_mtok
    return t


def _check_provider(m: ModelConfig) -> None:
    from gateway.backends.providers.config import ConfigError as ProviderConfigError
    from gateway.backends.providers.config import ProviderConfig

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


def check_routing(cfg: GatewayConfig) -> None:
    """[routing]'s bounds and [tiers]'s default tier hold."""
    if (
        not isinstance(cfg.routing.max_connections_per_node, int)
        or cfg.routing.max_connections_per_node < 1
    ):
        raise ConfigError("[routing] max_connections_per_node must be an integer >= 1")
    for name in ("connect_timeout_s", "read_timeout_s", "stall_timeout_s", "unreachable_exclude_s"):
        value = getattr(cfg.routing, name)
        least = 0 if name == "unreachable_exclude_s" else 1e-9  # 0 there: never left out
        if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
            raise ConfigError(
                f"[routing] {name} must be a number of seconds "
                f"{'>= 0' if least == 0 else '> 0'}, got {value!r}"
            )
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
    if not isinstance(cfg.tiers.fair_share, bool):
        raise ConfigError("[tiers] fair_share must be true or false")
    w = cfg.tiers.fair_output_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w <= 1000:
        raise ConfigError(f"[tiers] fair_output_weight must be a number in [0, 1000], got {w!r}")
    h = cfg.tiers.fair_headroom
    if h is not None and (
        not isinstance(h, int) or isinstance(h, bool) or not 0 <= h <= cfg.tiers.max_inflight
    ):
        raise ConfigError(
            f"[tiers] fair_headroom must be an integer in [0, max_inflight], got {h!r}"
        )
    a = cfg.tiers.fair_active_s
    if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a <= 3600:
        raise ConfigError(f"[tiers] fair_active_s must be seconds in (0, 3600], got {a!r}")
    ra = cfg.tiers.stream_read_ahead_bytes
    if not isinstance(ra, int) or isinstance(ra, bool) or not 0 <= ra <= 1 << 30:
        raise ConfigError(
            f"[tiers] stream_read_ahead_bytes must be an integer in [0, 2**30], got {ra!r}"
        )


def check_models(cfg: GatewayConfig) -> None:
    """The models' fallback chains, auto's candidates and the teams' policies name real models."""
    embedding = {n for n, m in cfg.models.items() if m.kind == "embedding"}
    for m in cfg.models.values():
        if m.kind == "external":
            _check_provider(m)
        chain = _names(f"models.{m.name}", "fallback", m.fallback, cfg.models)
        if m.name in chain:
            raise ConfigError(f"[models.{m.name}] fallback names the model itself")
        if embedding & set(chain):
            raise ConfigError(
                f"[models.{m.name}] fallback names an embedding model: "
                f"{', '.join(sorted(embedding & set(chain)))}"
            )
    if cfg.auto is not None:
        _names("auto", "models", cfg.auto.models, cfg.models)
        if embedding & set(cfg.auto.models):
            raise ConfigError(
                "[auto] models names an embedding model: "
                f"{', '.join(sorted(embedding & set(cfg.auto.models)))}"
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
        if isinstance(p.weight, bool) or not isinstance(p.weight, (int, float)):
            raise ConfigError(f"[teams.{team}] weight must be a number, got {p.weight!r}")
        if not 0.001 <= p.weight <= 1000:
            raise ConfigError(f"[teams.{team}] weight must be in [0.001, 1000], got {p.weight}")


def teams(data: Any) -> dict[str, TeamPolicy]:
    if not isinstance(data, dict):
        raise ConfigError("[teams] must be a table of [teams.<team id>] tables")
    return {t: build(TeamPolicy, f"teams.{t}", p) for t, p in data.items()}


def parse_batch(data: Any) -> BatchSettings:
    b = build(BatchSettings, "batch", data)
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


def check_server(server: ServerConfig) -> None:
    """[server]'s numbers and names hold."""
    if (
        not isinstance(server.key_cache_ttl_s, (int, float))
        or isinstance(server.key_cache_ttl_s, bool)
        or not 0 <= server.key_cache_ttl_s <= 3600
    ):
        raise ConfigError(
            "[server] key_cache_ttl_s must be a number of seconds in [0, 3600], got "
            f"{server.key_cache_ttl_s!r}"
        )
    for proxy in server.trusted_proxies:
        try:
            ipaddress.ip_network(proxy, strict=False)
        except (TypeError, ValueError):
            raise ConfigError(
                f"[server] trusted_proxies: not an address or network: {proxy!r}"
            ) from None
    problem = server.read_deadlines().problem()
    if problem is not None:
        raise ConfigError(f"[server] {problem}")
    wt = server.write_timeout_s
    if not isinstance(wt, int | float) or isinstance(wt, bool) or not 0 <= wt <= 86_400:
        raise ConfigError(
            f"[server] write_timeout_s must be a number of seconds in [0, 86400], got {wt!r}"
        )
    rt = server.request_timeout_s
    if not isinstance(rt, int | float) or isinstance(rt, bool) or not 0 <= rt <= 86_400:
        raise ConfigError(
            f"[server] request_timeout_s must be a number of seconds in [0, 86400], got {rt!r}"
        )
    gt, gn = server.guide_compile_timeout_s, server.guide_compile_threads
    if not isinstance(gt, int | float) or isinstance(gt, bool) or not 0 < gt <= 600:
        raise ConfigError(
            f"[server] guide_compile_timeout_s must be a number of seconds in (0, 600], got {gt!r}"
        )
    if not isinstance(gn, int) or isinstance(gn, bool) or not 1 <= gn <= 64:
        raise ConfigError(
            f"[server] guide_compile_threads must be an integer in [1, 64], got {gn!r}"
        )
    if (
        not isinstance(server.console_rpm, int)
        or isinstance(server.console_rpm, bool)
        or server.console_rpm < 0
    ):
        raise ConfigError(
            f"[server] console_rpm must be an integer >= 0, got {server.console_rpm!r}"
        )
    mp = server.max_provider_calls
    if not isinstance(mp, int) or isinstance(mp, bool) or mp < 0:
        raise ConfigError(
            f"[server] max_provider_calls must be an integer >= 0 (0: no bound), got {mp!r}"
        )
    inst = server.instance
    if inst is not None and (
        not isinstance(inst, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", inst)
    ):
        raise ConfigError(
            f"[server] instance must be 1-64 letters, digits, '_', '.', '-', got {inst!r}"
        )


def check_quotas(cfg: GatewayConfig) -> None:
    """[quotas]: the reservation TTL outlives three heartbeats."""
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
            "[quotas] default_max_concurrent must be an integer >= 0, got "
            f"{q.default_max_concurrent!r}"
        )
    if q.reservation_ttl_s < 3 * q.heartbeat_s:
        raise ConfigError(
            f"[quotas] reservation_ttl_s ({q.reservation_ttl_s}) must be at least 3 heartbeats "
            f"({3 * q.heartbeat_s}): a live gateway renews its reservations once a heartbeat"
        )
