"""`ClusterEmbedder`: an embedding model's nodes (`kind = "embedding"`, nodes started with
`--task embed`) behind the `Embedder` seam.

Route with `task: embed` through the coordinator (etcd's view or the model's `static` list
when no coordinator answers), then `POST /v1/embeddings` on the chosen node, retried on another
node when one fails (up to `[routing] max_attempts`). A node URL comes only from the router.
The reply's accounting says the prompt went out (a client that leaves then pays for it), which
node answered, and when.
"""

from __future__ import annotations

import logging
import time

from gateway.accounts.usage import Accounting
from gateway.backends.base import Embedder, EmbeddingAttempt, EmbeddingReply
from gateway.backends.node_client import NodeClient, NodeFailure
from gateway.backends.routing import Router
from gateway.config import RoutingConfig
from protocol.cluster import NodeTask
from protocol.embeddings import NodeEmbeddingRequest, NodeEmbeddingResponse
from protocol.openai import APIError
from protocol.route import RouteRequest

log = logging.getLogger("duet.gateway.embeddings")


class ClusterEmbedder(Embedder):
    """Route with `task: embed`, then one call to the chosen node. `embedding_size` is the
    model's vector size when the gateway knows it (its config.json)."""

    def __init__(
        self, nodes: NodeClient, router: Router, cfg: RoutingConfig, embedding_size: int | None
    ) -> None:
        self.nodes = nodes
        self.router = router
        self.cfg = cfg
        self.embedding_size = embedding_size

    def open(self, attempt: EmbeddingAttempt) -> EmbeddingReply:
        return EmbeddingReply(lambda acc: self._embed(attempt, acc), attempt)

    async def _embed(self, attempt: EmbeddingAttempt, acc: Accounting) -> NodeEmbeddingResponse:
        rid, ids = attempt.request_id, attempt.inputs
        exclude: list[str] = []
        failures: list[str] = []
        body = NodeEmbeddingRequest(inputs=ids, dimensions=attempt.dimensions)
        for _ in range(max(1, self.cfg.max_attempts)):
            route = await self.router.route(
                RouteRequest(
                    model=attempt.model.cluster_name,
                    block_hashes=[],
                    num_prompt_tokens=max(map(len, ids)),
                    max_tokens=1,
                    tier=attempt.tier,
                    exclude=exclude,
                    request_id=rid,
                    task=NodeTask.EMBED,
                )
            )
            node = route.decode
            acc.prompt_sent = True
            try:
                out = await self.nodes.embed(node.url, rid, body)
            except NodeFailure as e:
                log.warning(
                    "%s: embed node %s failed (%s); trying another", rid, node.node_id, e.reason
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
            acc.first_token_at = time.monotonic()
            return out
        raise APIError(
            503,
            f"every embed node tried failed: {'; '.join(failures)}",
            type_="service_unavailable",
            code="upstream_unavailable",
            retry_after_s=1,
        )
