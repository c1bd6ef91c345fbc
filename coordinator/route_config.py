"""What the routing policy (coordinator/policy.py) is configured with and what it answers: the
cost weights, the policy's thresholds, the outcome of a decision (the metric label) and the
decision itself, with the pending load it adds and the adapters it makes a node load."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from coordinator.kv_reuse import KVCosts, RouteReuse
from protocol.route import RouteResponse


@dataclass(frozen=True)
class RouteWeights:
    #: cost of prefilling one uncached prompt token
    prefill_token: float = 1.0
    #: cost of one prompt token already queued for prefill on the node
    queued_prefill_token: float = 1.0
    #: cost of one sequence running, waiting or pending on a decode node
    decode_seq: float = 32.0
    #: cost of a decode node's KV cache being full (scaled by its usage, 0..1)
    kv_usage: float = 256.0
    #: cost of loading a request's LoRA adapter onto a node that does not hold it (the node
    #: loads it between two steps; what it costs is the slot another adapter may lose)
    lora_load: float = 512.0
    #: cost of a sleeping node (its weights are rebuilt before the request runs)
    wake: float = 4096.0


@dataclass(frozen=True)
class PolicyConfig:
    #: the cost terms a decode candidate's score adds up
    weights: RouteWeights = RouteWeights()
    #: prefill on the decode node when fewer prompt tokens than this are uncached there
    local_prefill_tokens: int = 256
    #: a prefill node with this many prompt tokens queued (pending routes included) is saturated
    prefill_saturation_tokens: int = 8192
    #: a node whose last load report is older than this many seconds gets no new routes
    stale_load_s: float = 2.0
    #: a routing decision stops counting as pending load at the node's first load report this
    #: many seconds after it (the report then includes it)
    pending_settle_s: float = 0.3
    #: a pending decision no load report has settled stops counting after this many seconds
    pending_max_age_s: float = 5.0
    #: what reused KV costs by where it is, and whether nodes pull from each other
    kv: KVCosts = field(default_factory=KVCosts)


class RouteOutcome(enum.StrEnum):
    """Which plan won: the metric label of `duet:route_decisions` and the first word of the
    response's `reason` (refusals count as their error code instead: no_capacity,
    model_not_found, context_length_exceeded, bad_request)."""

    DISAGGREGATED = "disaggregated"
    #: the whole prompt is shorter than local_prefill_tokens
    LOCAL_SHORT = "local_short"
    #: D holds enough of the prompt that what is left is under local_prefill_tokens
    LOCAL_CACHED = "local_cached"
    LOCAL_NO_PREFILL = "local_no_prefill"
    LOCAL_PREFILL_IS_D = "local_prefill_is_d"
    LOCAL_P_SATURATED = "local_p_saturated"
    #: an embedding request, on the least loaded embed node (`decode` names it)
    EMBED = "embed"


@dataclass
class Decision:
    response: RouteResponse
    outcome: RouteOutcome
    #: what to add to pending: node id → (seqs, prefill tokens, blocks)
    pending: dict[str, tuple[int, int, int]]
    #: the chosen nodes that must load the request's LoRA adapter first
    lora_loads: list[str] = field(default_factory=list)
    reuse: RouteReuse | None = None
