"""`POST /v1/embeddings`: OpenAI's embeddings API on models of `kind = "embedding"`.

auth → parse and check (`parse_embedding`: input a string, strings, token ids or token-id
arrays; 1..2,048 items; encoding_format float | base64; dimensions ≥ 1; user) → the one
request pipeline (gateway/serving/pipeline.py, with the embeddings' `Embed` call of
gateway/serving/embed.py: the model, each input's tokens, the reservation, one attempt on the
model's embedder, the settlement) → OpenAI's response (`float` lists, or `base64` of the
little-endian float32 bytes). Traced as chat is: auth, tokenize and quota spans, and OTel's
embeddings span `embeddings {model}` around the call to the nodes.
"""

from __future__ import annotations

import time
from typing import TypeGuard

import msgspec
from aiohttp import web

from gateway.accounts.idempotency import HEADER, caller_of
from gateway.serving.embed import Embed, Embeddings
from gateway.serving.pipeline import run
from gateway.serving.requests import MAX_USER
from gateway.state import GatewayState
from protocol.embeddings import MAX_EMBEDDING_INPUTS, EmbeddingRequest
from protocol.openai import APIError

_DEC = msgspec.json.Decoder(EmbeddingRequest)
_ENC = msgspec.json.Encoder()


def _token_ids(inp: list[str | int | list[int]]) -> TypeGuard[list[int]]:
    return all(isinstance(x, int) and not isinstance(x, bool) for x in inp)


def _unmixed(inp: list[str | int | list[int]]) -> TypeGuard[list[str] | list[list[int]]]:
    """All strings, or all token-id lists."""
    return all(isinstance(x, str) for x in inp) or all(isinstance(x, list) for x in inp)


def parse_embedding(raw: bytes) -> Embeddings:
    """The checked request; its items are strings, or token-id lists (never mixed)."""
    try:
        body = _DEC.decode(raw)
    except msgspec.ValidationError as e:
        msg = str(e)
        param = (
            msg.rsplit("`$.", 1)[1].rstrip("`").split("[")[0].split(".")[0]
            if "`$." in msg
            else None
        )
        raise APIError(400, f"invalid request: {msg}", param=param) from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    inp = body.input
    items: list[str] | list[list[int]]
    if isinstance(inp, str):
        items = [inp]
    elif inp and _token_ids(inp):
        items = [list(inp)]
    elif _unmixed(inp):
        items = inp.copy()
    else:
        raise APIError(
            400,
            "input must be a string, an array of strings, an array of token ids or an array of "
            "token-id arrays (not a mix)",
            param="input",
        )
    if not items:
        raise APIError(400, "input must not be empty", param="input")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise APIError(
            400,
            f"input holds {len(items)} items; at most {MAX_EMBEDDING_INPUTS} per request",
            param="input",
        )
    for i, item in enumerate(items):
        if not item:
            raise APIError(400, f"input[{i}] is empty", param="input")
    if body.dimensions is not None and body.dimensions < 1:
        raise APIError(
            400, f"dimensions must be at least 1, got {body.dimensions}", param="dimensions"
        )
    if body.user is not None and len(body.user) > MAX_USER:
        raise APIError(
            400,
            f"user must be a string of at most {MAX_USER} characters, got {len(body.user)}",
            param="user",
        )
    return Embeddings(
        model=body.model,
        items=items,
        encoding_format=body.encoding_format,
        dimensions=body.dimensions,
        user=body.user or None,
    )


async def handle(state: GatewayState, request: web.Request, request_id: str) -> web.Response:
    """The HTTP handler: authenticate, run the pipeline, answer in OpenAI's shape."""
    t0 = time.monotonic()
    with state.tracing.span("gateway.auth"):
        key, team = await state.auth.authenticate(request)
    call = Embed(parse_embedding(await request.read()))
    answer = await run(
        state.serving,
        caller_of(key, team, request_id, t0, request.headers.get(HEADER)),
        call,
        tier_header=request.headers.get("x-duet-tier"),
    )
    return web.Response(
        body=_ENC.encode(answer.body), content_type="application/json", headers=answer.headers
    )
