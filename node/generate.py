"""vLLM's token-in/token-out endpoints on a node (protocol/generate.py), behind the cluster
secret like every node endpoint: `POST /inference/v1/generate` (token ids in, token ids and
their logprobs out) and the render endpoints `POST /v1/chat/completions/render` and
`POST /v1/completions/render` (a body's prompt as the token ids this node's tokenizer and chat
template make of it, and its sampling fields: a generate body; completions: a list of one).
`stream: true` streams vLLM's generate chunks (node/generate_stream.py).

The body becomes the `NodeCompletionRequest` it is (the prompt the token ids, the sampling
fields by their completions names, whole) and runs as a local leg of `/v1/completions` — the
same checks, context bound, scheduling and engine path — and the node's whole answer, which
carries each choice's token ids and (asked with `logprob_records`) its logprobs by token id,
is rendered in vLLM's shape. A refusal names the field as the generate body calls it
(`token_ids`, `sampling_params.temperature`).
"""

from __future__ import annotations

import asyncio
import time

import msgspec
from aiohttp import web

from node.chat import as_completion, parse_chat, template
from node.completions import dispatch, parse_body, prepare_body, served_adapter
from node.request_log import REQUEST_ID
from node.state import NodeState
from protocol.generate import (
    GenerateChoice,
    GenerateResponse,
    GenerateSamplingParams,
    Rendered,
    choice_logprobs,
    parse_generate,
    sampling_kwargs,
)
from protocol.node_api import NodeCompletion, NodeCompletionRequest
from protocol.openai import APIError
from protocol.structured import Guide, StructuredOutputs
from text.structured_form import as_structured_outputs, guide_of

_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(NodeCompletion)


async def handle_generate(state: NodeState, request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    body = parse_generate(await request.read())
    fields = sampling_kwargs(body.sampling_params)
    so = fields.pop("structured_outputs", None)
    leg = msgspec.structs.replace(
        NodeCompletionRequest(
            prompt=body.token_ids,
            model=body.model,
            stream=bool(body.stream),
            stream_options=body.stream_options,
            guide=_guide(so),
            logprob_records=True,  # the answer's logprobs are by token id (vLLM's form)
        ),
        **fields,
    )
    try:
        leg.validate()
        prep = await prepare_body(state, leg, arrival)
    except APIError as e:
        if e.param == "prompt":
            e.param = "token_ids"
        elif e.param in GenerateSamplingParams.__struct_fields__:
            e.param = f"sampling_params.{e.param}"
        elif e.param == "guide":
            e.param = "sampling_params.structured_outputs"
        raise
    # a stream goes out in generate's shape (node/generate_stream.py)
    prep.generate_id = body.request_id or prep.request_id
    prep.generate_prompt_ids = bool(body.return_token_ids)
    answer = await dispatch(state, request, prep)
    if body.stream or not isinstance(answer, web.Response) or answer.status != 200:
        return answer
    assert isinstance(answer.body, bytes)
    done = _DEC.decode(answer.body)
    assert done.usage is not None
    out = GenerateResponse(
        request_id=body.request_id or REQUEST_ID.get(),
        model=done.model,
        created=done.created,
        usage=done.usage,
        prompt_token_ids=prep.prompt_ids if body.return_token_ids else None,
        choices=[
            GenerateChoice(
                index=c.index,
                token_ids=c.token_ids or [],
                finish_reason=c.finish_reason,
                logprobs=choice_logprobs(c.logprobs),
            )
            for c in done.choices
        ],
    )
    return web.Response(body=_ENC.encode(out), content_type="application/json")


def _guide(so: object) -> Guide | None:
    """The constraint of `sampling_params.structured_outputs` (a 400 naming it for a form not
    served); the grammar engine's check is the completions path's."""
    if so is None:
        return None
    assert isinstance(so, StructuredOutputs)
    try:
        return guide_of(so)
    except ValueError as e:
        raise APIError(400, str(e), param="sampling_params.structured_outputs") from None


async def handle_render_chat(state: NodeState, request: web.Request) -> web.Response:
    """`POST /v1/chat/completions/render`: the chat body's prompt ids as this node templates
    them (what its `/v1/chat/completions` would compute)."""
    chat = parse_chat(await request.read())
    served_adapter(state.engine, chat.model)  # 404 for a model this node does not serve
    ids = await asyncio.to_thread(template, state.engine.tokenizer, chat)
    body = as_completion(chat, ids)
    body.validate()
    return _rendered(_render(state, body, ids))


async def handle_render_completion(state: NodeState, request: web.Request) -> web.Response:
    """`POST /v1/completions/render`: the completions body's prompt as token ids."""
    body = parse_body(await request.read())
    served_adapter(state.engine, body.model)
    prompt = body.single_prompt()
    ids = (
        await asyncio.to_thread(state.engine.tokenizer.encode, prompt)
        if isinstance(prompt, str)
        else list(prompt)
    )
    return _rendered([_render(state, body, ids)])


def _render(state: NodeState, body: NodeCompletionRequest, ids: list[int]) -> Rendered:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    sp = GenerateSamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        seed=body.seed,
        min_tokens=body.min_tokens or None,  # 0 and false are the defaults: unset
        ignore_eos=body.ignore_eos or None,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        repetition_penalty=body.repetition_penalty,
        stop=stop or None,
        logprobs=body.logprobs,
        structured_outputs=None if body.guide is None else as_structured_outputs(body.guide),
    )
    return Rendered(token_ids=ids, sampling_params=sp, model=body.model or state.engine.model_name)


def _rendered(out: Rendered | list[Rendered]) -> web.Response:
    return web.Response(body=_ENC.encode(out), content_type="application/json")
