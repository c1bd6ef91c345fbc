"""`POST /v1/completions` (and its chat form, node/chat.py) on a node: decode the body as a
`NodeCompletionRequest` (protocol.node_api), validate it, then run one of the legs — local
(prefill and decode here) or a leg a role registered for the `kv_transfer_params` trigger it
carries (node.legs: `do_remote_decode` → prefill leg, `do_remote_prefill` → decode leg) — with a
`Leg` context (node.leg_context), counted in flight from here to its answer.

Nothing here trusts the body: every field is type-checked (msgspec: no bool for an int, no
unknown kv_transfer_params shapes), range-checked (SamplingParams, the context length), and
string prompts are tokenized and guides grammar-checked (state.guides: text/guide_compile.py)
off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid

import msgspec
from aiohttp import web

from node.chat import as_completion, parse_chat, template
from node.engine_api import NodeEngine
from node.leg_context import Leg
from node.leg_spans import record_leg
from node.legs import PREFILL_TRIGGER, LegContext, Prepared, leg_trigger, prefill_request_id
from node.lora import adapter_names
from node.request_body import decode_request
from node.request_log import REQUEST_ID
from node.state import NodeState
from protocol.limits import over_context
from protocol.node_api import NodeCompletionRequest
from protocol.openai import APIError
from protocol.sampling import Priority, SamplingParams

log = logging.getLogger("duet.node")
_DEC = msgspec.json.Decoder(NodeCompletionRequest)


def parse_body(raw: bytes) -> NodeCompletionRequest:
    body = decode_request(_DEC, raw)
    body.validate()
    return body


def sampling_params(
    body: NodeCompletionRequest, max_tokens: int | None = None, lora_name: str | None = None
) -> SamplingParams:
    """The engine's params (`lora_name`: the adapter the body's model names). On a migrated leg
    (`resume`) max_tokens and min_tokens are the original request's: the tokens already
    streamed count against them."""
    done = body.resume.output_tokens if body.resume is not None else 0
    try:
        return SamplingParams(
            max_tokens=(max_tokens or body.max_tokens or 16) - done,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            seed=body.seed,
            stop=body.stop_list(),
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens
            - min(done, max(body.min_tokens, 0)),  # a negative one stays refused
            skip_special_tokens=body.skip_special_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=body.prompt_logprobs,
            cache_salt=body.cache_salt,
            resume=body.resume,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            min_p=body.min_p or 0.0,
            logit_bias={
                int(t): b for t, b in (body.logit_bias or {}).items()
            },  # keys checked by validate()
            guide=body.guide,
            lora_name=lora_name,
            retain=body.retain,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None


def check_resume(body: NodeCompletionRequest, num_ids: int) -> None:
    """A migrated leg's continuation point must lie inside its prompt and leave tokens to make."""
    r = body.resume
    if r is None:
        return
    if not 0 < r.output_tokens < num_ids or r.text_chars < 0 or r.migration < 1:
        raise APIError(
            400,
            f"resume must name 0 < output_tokens < the prompt's {num_ids} tokens, text_chars >= 0 "
            f"and migration >= 1, got {r}",
            param="resume",
        )
    if r.output_tokens >= (body.max_tokens or 16):
        raise APIError(
            400,
            f"resume.output_tokens ({r.output_tokens}) leaves nothing of max_tokens "
            f"({body.max_tokens}) to generate",
            param="resume",
        )
    if body.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs cannot be asked on a migrated leg", param="resume")


def check_transfer_params(body: NodeCompletionRequest) -> None:
    kv = body.kv_transfer_params
    if kv is not None and kv.do_remote_decode and kv.do_remote_prefill:
        raise APIError(
            400,
            "kv_transfer_params cannot ask for both do_remote_decode and do_remote_prefill",
            param="kv_transfer_params",
        )


async def prepare(state: NodeState, raw: bytes) -> Prepared:
    arrival = time.monotonic()
    return await prepare_body(state, parse_body(raw), arrival)


async def prepare_body(
    state: NodeState, body: NodeCompletionRequest, arrival: float, chat: bool = False
) -> Prepared:
    engine = state.engine
    adapter = served_adapter(engine, body.model)
    check_transfer_params(body)
    prompt = body.single_prompt()
    if isinstance(prompt, str):
        # Tokenizing a long prompt takes milliseconds: never on the event loop.
        ids = await asyncio.to_thread(engine.tokenizer.encode, prompt)
    else:
        ids = list(prompt)
    check_resume(body, len(ids))
    # the engine's words, before any engine work: off the event loop (a guide the size bounds
    # admit compiles for up to about a second, which would stall every stream of this node)
    await state.guides.check(body.guide, param="guide", domain=body.cache_salt)
    params = sampling_params(body, lora_name=adapter)
    if len(ids) + params.max_tokens > engine.max_model_len:
        raise APIError(
            400,
            over_context(engine.max_model_len, len(ids), params.max_tokens),
            param="max_tokens",
            code="context_length_exceeded",
        )
    priority = Priority.BATCH if body.priority == "batch" else Priority.INTERACTIVE
    return Prepared(
        request_id=REQUEST_ID.get(),
        body=body,
        prompt_ids=ids,
        params=params,
        priority=priority,
        arrival=arrival,
        chat=chat,
    )


def served_adapter(engine: NodeEngine, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); 404 for a model this
    node does not serve."""
    if not model or model == engine.model_name:
        return None
    adapters = adapter_names(engine)
    if model in adapters:
        return model
    also = f" and the LoRA adapters {adapters}" if adapters else ""
    raise APIError(
        404,
        f"model {model!r} is not served here (this node serves {engine.model_name!r}{also})",
        code="model_not_found",
        param="model",
    )


def injected_fault(state: NodeState) -> None:
    """`--fail-fraction f`: request n fails when it takes floor(n * f) past floor((n-1) * f)."""
    f = state.config.fail_fraction
    if not f:
        return
    state.completions_seen = n = state.completions_seen + 1
    if math.floor(n * f) > math.floor((n - 1) * f):
        raise APIError(500, "injected fault (--fail-fraction)", type_="server_error")


async def handle_completions(state: NodeState, request: web.Request) -> web.StreamResponse:
    raw = await request.read()
    injected_fault(state)
    return await dispatch(state, request, await prepare(state, raw))


async def handle_chat_completions(state: NodeState, request: web.Request) -> web.StreamResponse:
    """The chat form (node/chat.py): template the messages, then the completion path."""
    arrival = time.monotonic()
    chat = parse_chat(await request.read())
    ids = await asyncio.to_thread(template, state.engine.tokenizer, chat)
    body = as_completion(chat, ids)
    body.validate()
    return await dispatch(state, request, await prepare_body(state, body, arrival, chat=True))


async def dispatch(state: NodeState, request: web.Request, prep: Prepared) -> web.StreamResponse:
    """The local leg, or the leg a role registered for the request's kv_transfer_params, in a
    `Leg` context; the node counts it in flight until it has answered."""
    trigger = leg_trigger(prep.kv_params)
    handler = local_leg if trigger is None else state.roles.legs.get(trigger)
    if handler is None:
        raise APIError(
            400,
            f"this node ({state.roles.describe()}) does not serve {trigger} legs",
            param="kv_transfer_params",
        )
    erid = prefill_request_id(prep.request_id) if trigger == PREFILL_TRIGGER else prep.request_id
    state.enter(erid)
    leg = Leg(state, request, prep, erid)
    try:
        return await handler(leg)
    finally:
        state.leave(erid)
        kind = None if trigger is None else "prefill" if trigger == PREFILL_TRIGGER else "decode"
        record_leg(state.tracing, kind, leg.timing, prep.arrival, len(prep.prompt_ids))


async def local_leg(leg: LegContext) -> web.StreamResponse:
    """Prefill and decode here."""
    return await leg.respond(await leg.start(leg.prep.params))


def new_request_id() -> str:
    """For requests that arrive without an X-Request-Id."""
    return f"cmpl-{uuid.uuid4().hex}"
