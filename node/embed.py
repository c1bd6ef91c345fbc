"""The embed task of a node (`duet node --task embed`): `POST /v1/embeddings`, token ids in,
pooled L2-normalized vectors out (protocol/embeddings.py), registered with node/'s app like a
role (`register`; the composition root, duet.cmd_nodes, picks it instead of the P/D legs).

An embed node serves nothing else: its completion endpoints answer 400 (node/app.py), it runs
no KV transport, and it registers with `task: embed`, so routers send it embedding work only
(and a generation node never gets any: it has no such route). The engine batches concurrent
requests into shared forwards (engine/async_engine.py). Each request is counted in flight, so
a draining node finishes it before it exits; the latency lands in the node's e2e histogram.
"""

from __future__ import annotations

import time

import msgspec
from aiohttp import web

from node.engine_api import EmbeddingEngine, RequestRefused
from node.legs import Node, Roles
from node.request_body import decode_request
from node.request_log import REQUEST_ID
from protocol.embeddings import (
    MAX_EMBEDDING_INPUTS,
    NodeEmbeddingRequest,
    NodeEmbeddingResponse,
    le_float32,
)
from protocol.openai import APIError

_DEC = msgspec.json.Decoder(NodeEmbeddingRequest)
_ENC = msgspec.json.Encoder()
EMBED_PATH = "/v1/embeddings"


def register(roles: Roles) -> None:
    roles.add_role("embed")
    roles.add_route("POST", EMBED_PATH, handle_embeddings)
    roles.on_start.append(_check_engine)


async def _check_engine(node: Node) -> None:
    if not isinstance(node.engine, EmbeddingEngine):
        raise RuntimeError(
            f"the {node.config.engine_kind} engine does not serve embeddings (--task embed needs "
            "--engine native)"
        )


async def handle_embeddings(node: Node, request: web.Request) -> web.StreamResponse:
    t0 = time.monotonic()
    body = decode_request(_DEC, await request.read())
    if not body.inputs or len(body.inputs) > MAX_EMBEDDING_INPUTS:
        raise APIError(
            400,
            f"inputs must hold 1 to {MAX_EMBEDDING_INPUTS} token-id lists, got {len(body.inputs)}",
            param="inputs",
        )
    engine = node.engine
    assert isinstance(engine, EmbeddingEngine)
    rid = f"embed:{REQUEST_ID.get()}"
    node.enter(rid)  # in flight until answered: a draining node finishes it
    try:
        vectors = await engine.embed(body.inputs, node.config.pooling, body.dimensions)
    except RequestRefused as e:
        raise APIError(
            400, str(e), param="dimensions" if "dimensions" in str(e) else "input"
        ) from None
    finally:
        node.leave(rid)
    node.metrics.e2e.observe(time.monotonic() - t0)
    out = NodeEmbeddingResponse(
        model=node.engine.model_name,
        dim=body.dimensions or engine.embedding_size,
        vectors=[le_float32(v) for v in vectors],
        prompt_tokens=sum(map(len, body.inputs)),
    )
    return web.Response(body=_ENC.encode(out), content_type="application/json")
