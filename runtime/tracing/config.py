"""When tracing is on, where it exports, and how many finished spans a process keeps.

Turned on by config (`[tracing] enabled`, `--trace`) or the environment: `DUET_TRACING=1`, or
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set; `OTEL_SDK_DISABLED=true`
turns it off whatever else says on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

TRUE = ("1", "true", "yes", "on")
#: spans the gateway keeps for its console by default (about 20 spans a request)
DEFAULT_RING = 20_000
#: spans a node keeps for the console by default (4 to 6 a leg: the last few thousand legs)
NODE_RING = 20_000


@dataclass(frozen=True)
class TracingConfig:
    enabled: bool = False
    #: OTLP/HTTP base URL (…/v1/traces is added); None: the OTEL_EXPORTER_OTLP_* environment,
    #: and no export at all when that is unset
    endpoint: str | None = None
    #: finished spans kept in memory (0: none; None: the process's default — the gateway keeps
    #: DEFAULT_RING for its console, a node NODE_RING for the console to ask for, the
    #: coordinator none)
    ring_size: int | None = None
    #: share of new traces sampled (a request that arrives with a sampled traceparent is kept)
    sample_ratio: float = 1.0


def env_enabled(environ: Mapping[str, str] | None = None) -> bool | None:
    """What the environment says: True (on), False (OTEL_SDK_DISABLED) or None (nothing)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() in TRUE:
        return False
    if env.get("DUET_TRACING", "").lower() in TRUE:
        return True
    if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return True
    return None


def from_env(ring_size: int = 0, base: TracingConfig | None = None) -> TracingConfig:
    """`base` (a config file's section) with the environment's word on top."""
    base = base or TracingConfig()
    on = env_enabled()
    enabled = base.enabled if on is None else on
    return TracingConfig(
        enabled=enabled,
        endpoint=base.endpoint,
        ring_size=ring_size if base.ring_size is None else base.ring_size,
        sample_ratio=base.sample_ratio,
    )
