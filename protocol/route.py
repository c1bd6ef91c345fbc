"""The routing contract between the gateway and the coordinator (DESIGN §4).

`POST /route` with a `RouteRequest` → a `RouteResponse`, or an OpenAI-shaped error: 400 for a
malformed request, 404 `model_not_found` when no node serves the model, 503 `no_capacity`
(with `Retry-After`) when every eligible node is full or draining.

`prefill: null` means "prefill locally on the decode node" (conditional disaggregation).
`exclude` lets the gateway ask again after a node failed it, without that node.
`kv_source`, when set, names another node holding more of the prompt's prefix than the node
that computes the prompt (P, or D when `prefill` is null): the gateway passes it on that node's
leg (`NodeCompletionRequest.kv_source`), and the node pulls those blocks from it before computing
the rest — or computes them itself when the pull fails or is slow.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from protocol.cluster import NodeTask

Tier = Literal["interactive", "batch"]


class RouteRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str
    #: protocol.block_hash.block_hashes of the prompt's token ids (full blocks only)
    block_hashes: list[int]
    num_prompt_tokens: int
    max_tokens: int
    tier: Tier = "interactive"
    #: node ids the gateway does not want (they just failed this request)
    exclude: list[str] = []
    #: the X-Request-Id, for the coordinator's logs
    request_id: str | None = None
    #: embed: one node of `--task embed` (the answer's `decode`, `prefill` null; `max_tokens` is
    #: ignored and `num_prompt_tokens` is the longest item); generate: the P/D pair
    task: NodeTask = NodeTask.GENERATE
    #: the LoRA adapter the request runs with (`model` names its base model): routed to nodes
    #: with LoRA slots, preferring those that hold it; a chosen node that does not is told to
    #: load it first, from `lora_path` (a directory on the nodes) or from where a node that
    #: holds it loaded it (its GET /v1/models `root`)
    lora_name: str | None = None
    lora_path: str | None = None


class RouteTarget(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    url: str
    #: prompt tokens this node already holds in its prefix cache (per the coordinator's index)
    cached_tokens: int = 0


class KVSource(msgspec.Struct, frozen=True, kw_only=True):
    """A node to pull a prompt's KV from: it holds the prompt's first `num_blocks` blocks (per
    the coordinator's index); the computing node holds the first `from_block` itself."""

    node_id: str
    url: str
    num_blocks: int
    from_block: int = 0


class RouteResponse(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    prefill: RouteTarget | None
    decode: RouteTarget
    #: why this choice: for logs and for operators debugging routing
    reason: str
    #: where the computing node pulls the prompt's prefix from (None: it computes what it lacks)
    kv_source: KVSource | None = None
