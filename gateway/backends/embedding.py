"""`EmbeddingBackend`: an embedding model's nodes (`kind = "embedding"`, nodes started with
`--task embed`): route with `task: embed` through the coordinator (etcd's view or the model's
`static` list when no coordinator answers), then `POST /v1/embeddings` on the chosen node,
retried on another node when one fails (up to `[routing] max_attempts`). A node URL comes only
from the router.
"""

from __future__ import annotations

import logging

from gateway.backends.base import Accounting, Attempt, Backend, Reply, ServedModel
from gateway.backends.node_client import NodeClient, NodeFailure
from gateway.backends.providers.fallback import Reason
from gateway.backends.routing import Router
from gateway.config import RoutingConfig, Tier
from gateway.serving.requests import Endpoint, Request
from protocol.cluster import NodeTask
from protocol.embeddings import NodeEmbeddingRequest, NodeEmbeddingResponse
from protocol.openai import APIError
from protocol.route import RouteRequest

log = logging.getLogger("duet.gateway.embeddings")


class EmbeddingBackend(Backend):
    """An embedding model's nodes: route with `task: embed`, then one call to the chosen node.
    `embedding_size` is the model's vector size when the gateway knows it (its config.json)."""

    uses_tier_queues = True

    def __init__(
        self, nodes: NodeClient, router: Router, cfg: RoutingConfig, embedding_size: int | None
    ) -> None:
        self.nodes = nodes
        self.router = router
        self.cfg = cfg
        self.embedding_size = embedding_size

    def usable_for(self, endpoint: Endpoint, n: int) -> bool:
        return endpoint == Endpoint.EMBEDDING

    def open(self, request: Request, attempt: Attempt) -> Reply:
        raise APIError(
            400,
            f"{attempt.model.name!r} is an embedding model: use POST /v1/embeddings",
            param="model",
            code="wrong_model_kind",
        )

    def fallback_reason(self, err: APIError, tier: Tier) -> Reason | None:
        return None  # an embedding model has no fallback chain (gateway/config.py)

    async def embed(
        self,
        request_id: str,
        served: ServedModel,
        ids: list[list[int]],
        dimensions: int | None,
        tier: Tier,
        acc: Accounting,
    ) -> NodeEmbeddingResponse:
        exclude: list[str] = []
        failures: list[str] = []
        body = NodeEmbeddingRequest(inputs=ids, dimensions=dimensions)
        for _ in range(max(1, self.cfg.max_attempts)):
            route = await self.router.route(
                RouteRequest(
                    model=served.config.cluster_name,
                    block_hashes=[],
                    num_prompt_tokens=max(map(len, ids)),
                    max_tokens=1,
                    tier=tier,
                    exclude=exclude,
                    request_id=request_id,
                    task=NodeTask.EMBED,
                )
            )
            node = route.decode
            acc.prompt_sent = True
            try:
                out = await self.nodes.embed(node.url, request_id, body)
            except NodeFailure as e:
                log.warning(
                    "%s: embed node %s failed (%s); trying another",
                    request_id,
                    node.node_id,
                    e.reason,
                )
                failures.append(f"{node.node_id}: {e.reason}")
                exclude.append(node.node_id)
                continue
            acc.nodes.append(node.node_id)
            if len(out.vectors) != len(ids) or any(len(v) != 4 * out.dim for v in out.vectors):
                raise APIError(
                    502,
                    f"embed node {node.node_id} answered {len(out.vectors)} vectors for {len(ids)} "
                    "inputs",
                    type_="server_error",
                    code="bad_upstream",
                )
            return out
        raise APIError(
            503,
            f"every embed node tried failed: {'; '.join(failures)}",
            type_="service_unavailable",
            code="upstream_unavailable",
            retry_after_s=1,
        )
