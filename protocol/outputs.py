"""`RequestOutput`: what an engine reports for one request after one step — the one record the
native engine produces (engine/) and the node's engine interface hands on (node.engine_api
calls it `Delta`: the same class, so the native adapter passes the engine's outputs through
without copying a field).

It lives in protocol/ (like SamplingParams, the engine's input) because both engine/ and node/
use it and neither may import the other. Plain dataclass, torch-free: it is built once per token.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from protocol.kv_params import KVTransferParams
from protocol.logprobs import TokenLogprob


class Fault(enum.Enum):
    """Whose a request's failure in the engine is (finish_reason "error")."""

    #: the node's (a forward pass that raised, its memory): another node may well compute it
    ENGINE = "engine"
    #: the request's own: what it asked for cannot be computed (its sampling row turned
    #: non-finite, its guide refused a token), and every replica of the model computes the same,
    #: so it is answered as the client's error and never tried again elsewhere
    REQUEST = "request"


@dataclass
class RequestOutput:
    """A delta for one request (the offline API accumulates them)."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    #: why the engine failed this request (finish_reason "error"); other requests go on
    error: str | None = None
    #: whose that failure is (with `error`)
    fault: Fault = Fault.ENGINE
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    #: prefill node: the blocks held for transfer (on the finishing delta of a held request)
    held_block_ids: list[int] = field(default_factory=list)
    #: monotonic timestamps, on the finishing delta (None if the request never got there)
    arrival_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    #: with params.logprobs: one record per token of `new_token_ids`
    logprobs: list[TokenLogprob] | None = None
    #: with params.prompt_logprobs, on the delta of the first generated token: one entry per
    #: prompt token, None for the first (nothing predicts it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    #: engines that move KV themselves (vLLM): the params the engine answers with (a prefill's
    #: do_remote_prefill handoff), on the finishing delta; the native engine leaves it None
    kv_transfer_params: KVTransferParams | None = None
