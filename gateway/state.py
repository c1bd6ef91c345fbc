"""What the gateway app shares between handlers (one object under one web.AppKey)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp

from gateway.backend import Backend
from gateway.config import GatewayConfig, ModelConfig
from gateway.key_cache import KeyCache
from gateway.metrics import GatewayMetrics
from gateway.store.base import Store
from gateway.tiers import Admission
from gateway.usage_writer import UsageWriter
from runtime.tracing import Tracing
from text.guide_compile import GuideChecker
from text.tokenizer import Tokenizer


def _admin_guard() -> AdminGuard:
    from gateway.auth import AdminGuard  # auth imports this module

    return AdminGuard()


if TYPE_CHECKING:
    from gateway.auth import AdminGuard
    from gateway.choice import ModelChoice
    from gateway.etcd_view import EtcdView
    from gateway.ledger import Ledger
    from gateway.providers.metrics import ProviderMetrics


@dataclass
class ServedModel:
    config: ModelConfig
    backend: Backend
    tokenizer: Tokenizer | None
    #: prompt + completion tokens the model takes
    max_model_len: int


@dataclass
class GatewayState:
    config: GatewayConfig
    store: Store
    metrics: GatewayMetrics
    writer: UsageWriter
    admission: Admission
    #: API keys found recently (authentication without a store round trip)
    keys: KeyCache
    session: aiohttp.ClientSession | None = None
    #: the grammar check of constraints, off the event loop (made by the app from [server])
    guides: GuideChecker = field(default_factory=GuideChecker)
    models: dict[str, ServedModel] = field(default_factory=dict)
    #: auto, team policies and fallback chains (built once the models are loaded)
    choice: ModelChoice | None = None
    #: breaker-state gauge and duet:fallback_total, on `metrics.registry`
    provider_metrics: ProviderMetrics | None = None
    #: this process's identity in the store: its reservations and its heartbeat row
    gateway_id: str = field(default_factory=lambda: f"gw-{uuid.uuid4().hex[:16]}")
    #: failed admin authentications per address (gateway/auth.py)
    admin_guard: AdminGuard = field(default_factory=lambda: _admin_guard())
    #: OpenTelemetry (off: every span site is a no-op); its ring feeds the console
    tracing: Tracing = field(default_factory=Tracing.off)
    #: the cluster as etcd shows it (None without [routing] etcd) and the coordinator replicas'
    #: URLs (configured + registered): the console's cluster page
    etcd_view: EtcdView | None = None
    coordinator_urls: Callable[[], list[str]] = field(default_factory=lambda: list)
    #: reservation id → the ledger of each request reserved and not yet settled: the heartbeat
    #: reports their streamed tokens to the store (gateway/ledger.py)
    in_flight: dict[str, Ledger] = field(default_factory=dict)
