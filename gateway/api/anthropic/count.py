"""`POST /v1/messages/count_tokens`: how many input tokens a Messages request is on its model.

The body is a `/v1/messages` body without `max_tokens` (model, messages, system, tools,
tool_choice, output_config; `thinking` as `/v1/messages` takes it: refused unless disabled). It
is translated and checked exactly as `/v1/messages` translates and checks it (api.py `parse`,
convert.py `to_chat`, the chat path's `check_chat`), the model is chosen as the pipeline
chooses it (a name, or what `auto` picks; a forbidden model is a 403, an unknown one a 404),
and the prompt is rendered by the same function the pipeline tokenizes with
(gateway/serving/measure.py: the model's tokenizer and chat template, the tools as the model
takes them). So the count equals the `usage.input_tokens` (plus `cache_read_input_tokens` and
`cache_creation_input_tokens`) that `/v1/messages` reports for the same body.

A count needs a valid key and passes the team gate's cheap refusals (its concurrency and
requests-per-minute limits as this gateway counts them), and is counted among the team's
requests in flight while it tokenizes; it reserves nothing and writes no usage record (it
generates nothing, so nothing is billed), so it does not take a slot of the team's RPM window.
An external model has no local tokenizer: its count is a 400 saying so.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.api.anthropic.api import authenticate, error_response, parse, read_body
from gateway.api.anthropic.convert import to_chat
from gateway.api.anthropic.surface import refuse_thinking
from gateway.api.anthropic.wire import TokenCount
from gateway.serving.chat import check_chat
from gateway.serving.generate import Generate
from gateway.state import GatewayState
from protocol.openai import APIError

_ENC = msgspec.json.Encoder()


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.Response:
    try:
        _, team = await authenticate(state, request)
        body = parse(await read_body(state, request), counting=True)
        refuse_thinking(body, None)  # counted on the models with a tokenizer here: none reasons
        chat = to_chat(body)
        call = Generate(check_chat(chat.body, chat.vllm))
        tier_header = request.headers.get("x-duet-tier")
        _, ids = await call.own_prompt_ids(state.serving, team, tier_header, "counts tokens")
    except APIError as e:
        return error_response(e, request_id)
    return web.Response(
        body=_ENC.encode(TokenCount(input_tokens=len(ids))),
        content_type="application/json",
        headers={"X-Request-Id": request_id, "request-id": request_id},
    )
