"""vLLM's token-in/token-out endpoints on the gateway: `POST /inference/v1/generate`,
`POST /v1/chat/completions/render` and `POST /v1/completions/render` (protocol/generate.py).

generate is a completions request whose prompt is token ids: it is translated into one (the
sampling fields as the completions form names them) and checked, admitted, tiered, reserved,
run and billed by the one pipeline exactly as `/v1/completions` with the same ids would be,
with vLLM's `return_token_ids` on, so the answer's token ids and logprobs are the very tokens
the nodes made (the same ones `/v1/completions` answers with, as text). A bad field is a 400
naming it where the client wrote it (`sampling_params.max_tokens`, `token_ids`).

render answers what generate needs for a chat or completions body: the prompt's token ids as
the pipeline itself tokenizes it on the chosen model (its tokenizer, chat template and tools:
gateway/serving/measure.py, the same function `/v1/messages/count_tokens` counts with), and the
body's sampling fields in generate's shape, its constraint among them as vLLM's render writes
it (`sampling_params.structured_outputs`: `response_format`'s, vLLM's extras', or a forced
tool choice's on the model's tool format), so generate from a render is the body's request. Like
counting, it needs a key, passes the team gate's cheap refusals and counts in flight while it
tokenizes, reserves and bills nothing (it generates nothing). An external model has no local
tokenizer: a 400.

`stream: true` runs the streamed completions request instead and rewrites its chunks in flight
into vLLM's generate stream (gateway/api/generate_stream.py): billed once, as that request.
"""

from __future__ import annotations

import time
from dataclasses import replace

import msgspec
from aiohttp import web

from gateway.accounts.idempotency import HEADER, caller_of
from gateway.api.generate_stream import GenerateSink
from gateway.serving.generate import Generate, parse
from gateway.serving.measure import tool_plan
from gateway.serving.openai_format import CompletionResponse, TokenIdsChoice
from gateway.serving.pipeline import run
from gateway.serving.relay import HttpEventStream
from gateway.serving.requests import Endpoint, Request, parse_completion
from gateway.state import GatewayState
from protocol.generate import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
    Rendered,
    choice_logprobs,
    parse_generate,
    sampling_kwargs,
)
from protocol.openai import APIError, StreamOptions
from protocol.structured import StructuredOutputs
from text.structured_form import as_structured_outputs

_ENC = msgspec.json.Encoder()


class _AsCompletion(GenerateSamplingParams, kw_only=True, omit_defaults=True):
    """A generate request as the completions body it is (checked by the completions parser)."""

    model: str
    prompt: list[int]
    #: required, so omit_defaults never drops it
    return_token_ids: bool
    stream: bool = False
    stream_options: StreamOptions | None = None


async def generate(
    state: GatewayState, request: web.Request, request_id: str
) -> web.StreamResponse:
    """`POST /inference/v1/generate`: token ids in, token ids and logprobs out (whole or
    streamed), billed."""
    t0 = time.monotonic()
    key, team = await state.auth.authenticate(request)
    body = _generate_body(await request.read())
    http = HttpEventStream(request)
    caller = caller_of(key, team, request_id, t0, request.headers.get(HEADER))
    request_id = caller.request_id
    answer = await run(
        state.serving,
        caller,
        Generate(_as_completion(body)),
        tier_header=request.headers.get("x-duet-tier"),
        sink=GenerateSink(http, body.request_id or request_id, bool(body.return_token_ids)),
    )
    done = answer.body
    if done is None:  # streamed: the answer went to the sink
        assert http.response is not None
        return http.response
    assert isinstance(done, CompletionResponse) and done.usage is not None
    first = done.choices[0] if done.choices else None
    out = GenerateResponse(
        request_id=body.request_id or request_id,
        model=done.model,
        created=done.created,
        usage=done.usage,
        prompt_token_ids=first.prompt_token_ids
        if body.return_token_ids and isinstance(first, TokenIdsChoice)
        else None,
        choices=[
            GenerateChoice(
                index=c.index,
                token_ids=c.token_ids if isinstance(c, TokenIdsChoice) else [],
                finish_reason=c.finish_reason,
                logprobs=choice_logprobs(c.logprobs),
            )
            for c in done.choices
        ],
    )
    return web.Response(
        status=answer.status,
        body=_ENC.encode(out),
        content_type="application/json",
        headers=answer.headers,
    )


async def render(
    state: GatewayState, request: web.Request, endpoint: Endpoint, request_id: str
) -> web.Response:
    """`POST /v1/{chat/}completions/render`: the body's prompt as the token ids the chosen model
    is sent, and its sampling fields, as a generate request (completions: a list of one)."""
    _, team = await state.auth.authenticate(request)
    call = parse(endpoint, await request.read())
    tier_header = request.headers.get("x-duet-tier")
    served, ids = await call.own_prompt_ids(state.serving, team, tier_header, "renders prompts")
    # the answer's constraint as the model is sent it: the body's, or its forced tool choice's
    # in this model's tool format (the tools themselves are in the prompt's ids)
    plan = tool_plan(served, call.request)
    guide = call.request.guide_on(served.config.closed_objects) or (
        plan.guide if plan is not None else None
    )
    sampling = _sampling_of(call.request, None if guide is None else as_structured_outputs(guide))
    out = Rendered(token_ids=ids, sampling_params=sampling, model=served.config.name)
    return web.Response(
        body=_ENC.encode(out if endpoint == Endpoint.CHAT else [out]),
        content_type="application/json",
        headers={"X-Request-Id": request_id},
    )


def _generate_body(raw: bytes) -> GenerateRequest:
    body = parse_generate(raw)
    if body.model is None:  # the gateway serves several models
        raise APIError(400, "missing required field: model", param="model")
    return body


def _as_completion(body: GenerateRequest) -> Request:
    """The completions request `body` is, checked by the completions parser; a refusal names
    the field as the generate body calls it."""
    assert body.model is not None
    # the sampling fields through replace: typed, where a dict splat into the constructor is not
    as_completion = msgspec.structs.replace(
        _AsCompletion(
            model=body.model,
            prompt=body.token_ids,
            return_token_ids=True,
            stream=bool(body.stream),
            stream_options=body.stream_options,
        ),
        **sampling_kwargs(body.sampling_params),
    )
    try:
        # its logprobs by token id, with ranks: the engine's records (vLLM's form)
        return replace(parse_completion(_ENC.encode(as_completion)), logprob_records=True)
    except APIError as e:
        if e.param == "prompt":
            e.param = "token_ids"
            e.message = e.message.replace("the prompt", "token_ids").replace("prompt", "token_ids")
        elif e.param and e.param.split(".")[0] in GenerateSamplingParams.__struct_fields__:
            e.param = f"sampling_params.{e.param}"
        raise


def _sampling_of(req: Request, so: StructuredOutputs | None) -> GenerateSamplingParams:
    """The request's sampling fields in generate's shape (unset stays unset), and its
    constraint `so`."""
    s = req.sampling
    return GenerateSamplingParams(
        max_tokens=req.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        min_tokens=s.min_tokens or None,  # 0 and false are the defaults: unset
        ignore_eos=s.ignore_eos or None,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty,
        stop=list(s.stop) or None,
        n=req.n if req.n != 1 else None,
        logprobs=s.logprobs,
        structured_outputs=so,
    )
