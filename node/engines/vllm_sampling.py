"""duet's request → vLLM's: SamplingParams, the guide (vLLM's structured outputs) and the
KV handoff dict of vLLM's connector.

vLLM is imported inside the functions, so this module loads without it (tests/vllm's units
check the mapping field by field). The handoff crosses as vLLM's own dict with vLLM's field
names; duet keeps it typed (`KVTransferParams`) everywhere else.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from protocol.kv_params import KVTransferParams
from protocol.sampling import SamplingParams
from protocol.structured import Guide, GuideKind
from text.json_bounds import bounded_spec


def kv_params_to_vllm(p: KVTransferParams) -> dict[str, Any]:
    """duet's typed handoff → the dict vLLM's connector reads (set fields only, vLLM's names)."""
    return msgspec.to_builtins(p)


def kv_params_from_vllm(d: dict[str, Any] | None) -> KVTransferParams | None:
    """vLLM connector's answer dict → duet's typed handoff (fields unknown to duet are dropped)."""
    return None if d is None else msgspec.convert(d, KVTransferParams)


def vllm_sampling(params: SamplingParams, kv_transfer_params: KVTransferParams | None) -> Any:
    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    extra = (
        {"kv_transfer_params": kv_params_to_vllm(kv_transfer_params)}
        if kv_transfer_params is not None
        else None
    )
    return VSP(
        n=1,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        seed=params.seed,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids) or None,
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        repetition_penalty=params.repetition_penalty,
        min_p=params.min_p,
        logit_bias=dict(params.logit_bias) or None,
        **vllm_guide(params.guide),
    )


def vllm_guide(guide: Guide | None) -> dict[str, Any]:
    """The guide as vLLM's own structured outputs: `structured_outputs=StructuredOutputsParams`
    (vLLM >= 0.10.2), else the older `guided_decoding=GuidedDecodingParams`; same field names.
    The backend (llguidance) and compact JSON are engine-wide settings (vllm_config's
    STRUCTURED_OUTPUTS): vLLM ignores a request's own whitespace fields."""
    if guide is None:
        return {}
    match guide.kind:
        case GuideKind.JSON_OBJECT:
            fields: dict[str, Any] = {"json_object": True}
        case (
            GuideKind.JSON_SCHEMA
        ):  # bounded numbers cut as on the native engine (text/json_bounds.py)
            fields = {"json": bounded_spec(guide.spec)}
        case GuideKind.REGEX:
            fields = {"regex": guide.spec}
        case GuideKind.CHOICE:
            fields = {"choice": json.loads(guide.spec)}
    try:
        from vllm.sampling_params import StructuredOutputsParams

        return {"structured_outputs": StructuredOutputsParams(**fields)}
    except ImportError:
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**fields)}
