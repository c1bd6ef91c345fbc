"""OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`: the HTTP handlers.

A completion request is authenticated and parsed here (gateway/serving/chat.py, requests.py) and
served by the one pipeline (gateway/serving/pipeline.py); its `Answer` is rendered here: a
streamed answer went to the `HttpEventStream` already, a whole one is its JSON body.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from gateway.accounts.idempotency import HEADER, caller_of
from gateway.config import AUTO
from gateway.config_adapters import adapter_card, may_use
from gateway.serving.generate import parse
from gateway.serving.pipeline import run
from gateway.serving.relay import HttpEventStream
from gateway.serving.requests import Endpoint
from gateway.state import GatewayState

_ENC = msgspec.json.Encoder()


async def handle(
    state: GatewayState, request: web.Request, endpoint: Endpoint, request_id: str
) -> web.StreamResponse:
    """The HTTP handler of both endpoints: authenticate, run, render the Answer."""
    t0 = time.monotonic()
    with state.tracing.span("gateway.auth"):
        key, team = await state.auth.authenticate(request)
    call = parse(endpoint, await request.read())
    sink = HttpEventStream(request)
    answer = await run(
        state.serving,
        caller_of(key, team, request_id, t0, request.headers.get(HEADER)),
        call,
        tier_header=request.headers.get("x-duet-tier"),
        sink=sink,
    )
    if answer.body is None:
        assert sink.response is not None
        return sink.response
    return web.Response(
        status=answer.status,
        body=_ENC.encode(answer.body),
        content_type="application/json",
        headers=answer.headers,
    )


async def models(s: GatewayState, request: web.Request) -> web.Response:
    """`GET /v1/models`: every model served that the caller may use (a team key sees no model
    kept from its team), and `auto` when it is served (admin or team key). A LoRA adapter's
    card names its base model as `parent` and the adapter as `root`, as vLLM's does."""
    team = await s.auth.admin_or_team(request)
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "external" if m.config.kind == "external" else "duet",
            "max_model_len": m.max_model_len,
            "capability_rank": m.config.capability_rank,
            "tiers": list(m.config.tiers),
            "fallback": list(m.config.fallback),
            **adapter_card(m.config),
        }
        for name, m in sorted(s.serving.models.items())
        if may_use(m.config, team.id if team is not None else None)
    ]
    if s.serving.choice.serves_auto:
        data.append(
            {
                "id": AUTO,
                "object": "model",
                "created": 0,
                "owned_by": "duet",
                "candidates": sorted(s.serving.choice.auto_catalog),
            }
        )
    return web.Response(
        body=_ENC.encode({"object": "list", "data": data}), content_type="application/json"
    )
