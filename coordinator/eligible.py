"""Which nodes may take a request at all, before any cost is weighed (coordinator/policy.py):
the request checked, then the nodes that serve its model and task, fit its context, are active,
not excluded and reporting fresh load — or the refusal that says why none is (404
model_not_found, 400 context_length_exceeded, 503 no_capacity).
"""

from __future__ import annotations

from collections.abc import Iterable

from coordinator.nodes import NodeView
from protocol.cluster import NodeStatus, NodeTask
from protocol.openai import APIError
from protocol.route import RouteRequest


def validate(req: RouteRequest) -> None:
    if not req.model:
        raise APIError(400, "'model' must be a non-empty string", param="model")
    if req.num_prompt_tokens < 1:
        raise APIError(
            400,
            f"'num_prompt_tokens' must be ≥ 1, got {req.num_prompt_tokens}",
            param="num_prompt_tokens",
        )
    if req.max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be ≥ 1, got {req.max_tokens}", param="max_tokens")
    if len(req.block_hashes) > req.num_prompt_tokens:
        raise APIError(
            400,
            f"{len(req.block_hashes)} block hashes for a prompt of {req.num_prompt_tokens} "
            "tokens: a hash covers a full block of tokens",
            param="block_hashes",
        )
    if req.block_hashes and (min(req.block_hashes) < 0 or max(req.block_hashes) >= 2**64):
        bad = next(h for h in req.block_hashes if not 0 <= h < 2**64)
        raise APIError(
            400, f"block hash {bad} is not an unsigned 64-bit integer", param="block_hashes"
        )


def usable_nodes(
    req: RouteRequest, nodes: Iterable[NodeView], now: float, stale: float
) -> tuple[list[NodeView], list[str]]:
    """One pass over the cluster: what serves the model, fits the request, and is usable
    (and the ids of every node serving it); the refusal that says why when nothing is."""
    excluded = set(req.exclude) if req.exclude else ()
    task = req.task
    # an embedding item needs no room for a generated token
    need_len = req.num_prompt_tokens + (req.max_tokens if task == NodeTask.GENERATE else 0)
    model = req.model
    serving: list[str] = []
    bs, longest = 1 << 30, 0
    fits = 0
    usable: list[NodeView] = []
    base_only = 0  # nodes of the model without LoRA slots, for an adapter's request
    for n in nodes:
        info = n.info
        if info.model != model or info.task != task:  # never one task's work on the other's node
            continue
        if req.lora_name and not info.max_loras:
            base_only += 1
            continue
        serving.append(n.node_id)
        bs = min(bs, info.block_size)
        longest = max(longest, info.max_model_len)
        if need_len > info.max_model_len:
            continue
        fits += 1
        if info.status == NodeStatus.ACTIVE and n.node_id not in excluded and n.ready(now, stale):
            usable.append(n)
    if not serving and base_only:
        raise APIError(
            404,
            f"no node serving {req.model!r} serves LoRA adapters (start nodes with --max-loras)",
            param="model",
            code="model_not_found",
        )
    if not serving:
        what = "embeddings of model" if task == NodeTask.EMBED else "model"
        raise APIError(
            404,
            f"no node serves {what} {req.model!r}",
            type_="invalid_request_error",
            param="model",
            code="model_not_found",
        )
    if len(req.block_hashes) * bs > req.num_prompt_tokens:
        raise APIError(
            400,
            f"{len(req.block_hashes)} block hashes of {bs} tokens do not fit in a prompt "
            f"of {req.num_prompt_tokens} tokens (hash full blocks only)",
            param="block_hashes",
        )
    if not fits and task == NodeTask.EMBED:
        raise APIError(
            400,
            f"an input of {req.num_prompt_tokens} tokens exceeds the context of every embed node "
            f"serving {req.model!r} ({longest})",
            param="input",
            code="context_length_exceeded",
        )
    if not fits:
        raise APIError(
            400,
            f"prompt ({req.num_prompt_tokens} tokens) + max_tokens ({req.max_tokens}) "
            f"exceeds the context of every node serving {req.model!r} ({longest})",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if not usable:
        raise APIError(
            503,
            f"no node serving {req.model!r} can take new work now "
            f"({fits} registered, none active, reachable and not excluded)",
            type_="service_unavailable",
            code="no_capacity",
            retry_after_s=1,
        )
    return usable, serving
