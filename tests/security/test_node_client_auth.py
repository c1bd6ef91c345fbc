"""Every request the gateway's NodeClient sends to a node carries the cluster secret.

The embeddings call was added after the secret and first went out without it: every
`/v1/embeddings` of a `duet up` cluster (which always has a secret) was a 401. This checks each
of NodeClient's calls against a real aiohttp server guarded by the nodes' own middleware
(runtime.cluster_secret.auth_middleware), so a call added later without the header fails here.
"""

from __future__ import annotations

import secrets

import aiohttp
import msgspec
from aiohttp import web

from gateway.backends.node_client import NodeClient
from protocol.embeddings import NodeEmbeddingRequest, NodeEmbeddingResponse
from protocol.kv_params import KVTransferParams
from protocol.node_api import NodeCompletion, NodeCompletionRequest
from protocol.openai import CompletionChoice
from runtime.cluster_secret import ClusterSecret, auth_middleware


async def test_each_node_call_sends_the_secret(aiohttp_server) -> None:
    secret = ClusterSecret(secrets.token_urlsafe(32), "test")
    seen: list[str] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append("completions")
        body = NodeCompletion(
            id="x",
            model="m",
            choices=[CompletionChoice(text="hi", finish_reason="stop")],
            kv_transfer_params=KVTransferParams(do_remote_prefill=True),
        )
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def embeddings(request: web.Request) -> web.Response:
        seen.append("embeddings")
        body = NodeEmbeddingResponse(
            model="m", dim=1, vectors=[b"\x00\x00\x80\x3f"], prompt_tokens=2
        )
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def abort(request: web.Request) -> web.Response:
        seen.append("abort")
        return web.json_response({})

    app = web.Application(middlewares=[auth_middleware(secret)])
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/abort", abort)
    server = await aiohttp_server(app)
    url = str(server.make_url("")).rstrip("/")
    async with aiohttp.ClientSession() as session:
        nodes = NodeClient(session, 5.0, 10.0, 10.0, auth=secret.headers)
        out = await nodes.prefill(url, "r1", NodeCompletionRequest(prompt=[1, 2], max_tokens=1))
        assert out.choices[0].text == "hi"
        emb = await nodes.embed(url, "r2", NodeEmbeddingRequest(inputs=[[1, 2]]))
        assert emb.dim == 1
        await nodes.abort(url, "r3")
    assert seen == ["completions", "embeddings", "abort"]
