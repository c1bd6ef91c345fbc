"""What the gateway app shares between handlers (one object under one web.AppKey)."""

from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp

from gateway.backend import Backend
from gateway.config import GatewayConfig, ModelConfig
from gateway.metrics import GatewayMetrics
from gateway.store.base import Store
from gateway.tiers import Admission
from gateway.usage_writer import UsageWriter
from protocol.tokenizer import Tokenizer


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
    session: aiohttp.ClientSession | None = None
    models: dict[str, ServedModel] = field(default_factory=dict)
