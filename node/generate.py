"""`POST /inference/v1/generate` on a node (vLLM's token-in/token-out endpoint,
protocol/generate.py): token ids in, token ids and their logprobs out, behind the cluster
secret like every node endpoint.

The body becomes the `NodeCompletionRequest` it is (the prompt the token ids, the sampling
fields by their completions names, whole) and runs as a local leg of `/v1/completions` — the
same checks, context bound, scheduling and engine path — and the node's whole answer, which
carries each choice's token ids, is rendered in vLLM's shape. A refusal names the field as the
generate body calls it (`token_ids`, `sampling_params.temperature`).
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from node.completions import dispatch, prepare_body
from node.request_log import REQUEST_ID
from node.state import NodeState
from protocol.chat import chat_logprobs
from protocol.generate import (
    GenerateChoice,
    GenerateResponse,
    GenerateSamplingParams,
    parse_generate,
    sampling_kwargs,
)
from protocol.node_api import NodeCompletion, NodeCompletionRequest
from protocol.openai import APIError

_ENC = msgspec.json.Encoder()
_DEC = msgspec.json.Decoder(NodeCompletion)


async def handle_generate(state: NodeState, request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()
    body = parse_generate(await request.read())
    leg = NodeCompletionRequest(
        prompt=body.token_ids,
        model=body.model,
        stream=False,
        **sampling_kwargs(body.sampling_params),
    )
    try:
        leg.validate()
        prep = await prepare_body(state, leg, arrival)
    except APIError as e:
        if e.param == "prompt":
            e.param = "token_ids"
        elif e.param in GenerateSamplingParams.__struct_fields__:
            e.param = f"sampling_params.{e.param}"
        raise
    answer = await dispatch(state, request, prep)
    if not isinstance(answer, web.Response) or answer.status != 200:
        return answer
    assert isinstance(answer.body, bytes)
    done = _DEC.decode(answer.body)
    assert done.usage is not None
    out = GenerateResponse(
        request_id=body.request_id or REQUEST_ID.get(),
        usage=done.usage,
        choices=[
            GenerateChoice(
                index=c.index,
                token_ids=c.token_ids or [],
                finish_reason=c.finish_reason,
                logprobs=None if c.logprobs is None else chat_logprobs(c.logprobs),
            )
            for c in done.choices
        ],
    )
    return web.Response(body=_ENC.encode(out), content_type="application/json")
