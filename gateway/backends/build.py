"""The models a gateway serves, built from its config: one `ServedModel` per `[models.X]`, each
with the backend that answers it.

- `kind = "cluster"`: the one `ClusterBackend` (duet's P/D nodes), with the model's tokenizer
  and context length (its config's `max_model_len`, else its config.json's);
- `kind = "embedding"`: a `ClusterEmbedder` routing to `--task embed` nodes;
- `kind = "external"`: a `ProviderBackend` around the model's provider
  (gateway/backends/providers/),
  every one sharing the gateway's bound on provider calls (`ProviderSlots`).

Routing: the coordinator replicas (configured, plus those registered in etcd) first; the
static node lists (configured, else etcd's view) of the task's nodes when no replica answers,
or when there is none.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from gateway.backends.base import Backend, Embedder, ServedModel
from gateway.backends.cluster.backend import ClusterBackend
from gateway.backends.embedding import ClusterEmbedder
from gateway.backends.etcd_view import EtcdView
from gateway.backends.node_client import NodeClient
from gateway.backends.provider import ProviderBackend
from gateway.backends.provider_slots import ProviderSlots
from gateway.backends.providers import build_provider
from gateway.backends.providers.config import ProviderConfig
from gateway.backends.routing import (
    CoordinatorRouter,
    FailoverRouter,
    NodeLoad,
    Router,
    StaticRouter,
)
from gateway.config import GatewayConfig, ModelConfig, StaticNodes, provider_table
from gateway.metrics import GatewayMetrics
from protocol.cluster import NodeTask
from runtime.models import resolve_model
from runtime.tracing import Tracing
from text.tokenizer import Tokenizer

log = logging.getLogger("duet.gateway")


@dataclass(frozen=True)
class Wiring:
    """What the backends are built on: the config, the one HTTP session, the client for the
    nodes, etcd's view of the cluster (None without [routing] etcd), metrics and tracing."""

    config: GatewayConfig
    session: aiohttp.ClientSession
    nodes: NodeClient
    view: EtcdView | None
    metrics: GatewayMetrics
    tracing: Tracing


def served_models(w: Wiring, cluster: ClusterBackend) -> dict[str, ServedModel]:
    """Every configured model, by name, with its backend (`cluster` answers the cluster ones)."""
    cfg, rc = w.config, w.config.routing
    slots = ProviderSlots(cfg.server.max_provider_calls, w.metrics)  # one bound for all
    embed_router = (
        router(w, cluster.load, NodeTask.EMBED)
        if any(m.kind == "embedding" for m in cfg.models.values())
        else None
    )
    models: dict[str, ServedModel] = {}
    #: one tokenizer per directory: a base model's LoRA adapters count prompts with its own
    tokenizers: dict[Path, Tokenizer] = {}
    for name, m in cfg.models.items():
        if m.kind == "external":
            models[name] = ServedModel(
                m, _external(m, w.session, slots), None, m.max_model_len or 1 << 20
            )
            continue
        assert m.tokenizer is not None  # the config refuses a self-hosted model without one
        directory = resolve_model(m.tokenizer).directory
        backend: Backend | Embedder = cluster
        if m.kind == "embedding":
            assert embed_router is not None
            backend = ClusterEmbedder(w.nodes, embed_router, rc, _embedding_size(directory))
        tok = tokenizers.get(directory) or tokenizers.setdefault(directory, Tokenizer(directory))
        _ = tok.max_token_chars  # its vocabulary read once here, not on a request's path
        models[name] = ServedModel(m, backend, tok, _max_model_len(m, directory))
    return models


def cluster_backend(w: Wiring, load: NodeLoad) -> ClusterBackend:
    """The backend of every `kind = "cluster"` model (one: it holds the nodes' load counts)."""
    return ClusterBackend(
        w.nodes,
        router(w, load),
        load,
        w.config.routing,
        on_retry=lambda k: w.metrics.retries.labels(kind=k).inc(),
        tracing=w.tracing,
    )


def coordinator_urls(config: GatewayConfig, view: EtcdView | None) -> Callable[[], list[str]]:
    """The coordinator replicas: the configured ones, then those registered in etcd."""
    configured = list(config.routing.coordinator)

    def urls() -> list[str]:
        return configured + [u for u in (view.coordinators if view else []) if u not in configured]

    return urls


def router(w: Wiring, load: NodeLoad, task: NodeTask = NodeTask.GENERATE) -> Router:
    """Coordinator replicas first; the static node lists of the task's nodes when no replica
    answers, or when there is none."""
    cfg, view = w.config, w.view
    static = StaticRouter(
        lambda name: _static_nodes(cfg, name, task) or (view.pool(name, task) if view else None),
        load,
    )
    if not cfg.routing.coordinator and view is None:
        return static
    coord = CoordinatorRouter(
        w.session,
        coordinator_urls(cfg, view),
        cfg.routing.route_timeout_s,
        cfg.security.headers,
    )
    return FailoverRouter(
        coord, static, lambda reason: w.metrics.route_fallback.labels(reason=reason).inc()
    )


def _static_nodes(
    cfg: GatewayConfig, cluster_name: str, task: NodeTask = NodeTask.GENERATE
) -> StaticNodes | None:
    for m in cfg.models.values():
        if (
            m.cluster_name == cluster_name
            and m.static is not None
            and (m.kind == "embedding") == (task == NodeTask.EMBED)
        ):
            return m.static
    return None


def _external(
    model: ModelConfig, session: aiohttp.ClientSession, slots: ProviderSlots
) -> ProviderBackend:
    cfg = ProviderConfig.from_dict(provider_table(model))
    if cfg.api_key_env and not cfg.api_key():
        log.warning(
            "model %s: $%s is not set; its calls will fail (and fall back) until it is",
            model.name,
            cfg.api_key_env,
        )
    return ProviderBackend(model, build_provider(cfg, session), slots)


def _max_model_len(m: ModelConfig, directory: Path) -> int:
    if m.max_model_len:
        return m.max_model_len
    f = directory / "config.json"
    cfg = json.loads(f.read_text()) if f.is_file() else {}
    return int(cfg.get("max_position_embeddings") or 4096)


def _embedding_size(directory: Path) -> int | None:
    """An embedding model's vector size (config.json's hidden_size; None: unknown here, the
    node checks `dimensions` then)."""
    f = directory / "config.json"
    size = json.loads(f.read_text()).get("hidden_size") if f.is_file() else None
    return int(size) if size else None
