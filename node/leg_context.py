"""`Leg`: the node's implementation of node.legs.LegContext — one leg of one request, from the
engine request it queues to the answer it writes.

Every leg (local, prefill, decode; native or vLLM) answers through here, so the answer's shapes
live in one place: a whole `NodeCompletion` (or its chat form), a stream of
`NodeCompletionChunk`s (or chat chunks), or a stream holding only an error event. One
`Responder` per leg keeps the timing and aborts the engine request when an answer does not
complete.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from node.chat import ChatChunker, chat_response
from node.engine_api import EngineStream, KVHandoff, RequestRefused
from node.generate_stream import GenerateChunker
from node.kv_events import KV_EVENTS
from node.legs import Prepared
from node.responder import Chunker, Responder
from node.state import NodeState
from protocol.node_api import NodeCompletion
from protocol.openai import APIError
from protocol.sampling import SamplingParams
from protocol.sse import SSE_HEADERS, end_stream, error_event

_ENC = msgspec.json.Encoder()


class Leg:
    def __init__(
        self, state: NodeState, request: web.Request, prep: Prepared, engine_request_id: str
    ) -> None:
        self.node = state
        self.request = request
        self.prep = prep
        self.engine_request_id = engine_request_id
        resumed = prep.body.resume.output_tokens if prep.body.resume is not None else 0
        self._responder = Responder(
            state,
            prep.request_id,
            engine_request_id,
            prep.arrival,
            resumed,
            prep.body.logprob_records,
        )

    @property
    def timing(self) -> dict[str, float]:
        return self._responder.timing

    async def start(self, params: SamplingParams, handoff: KVHandoff | None = None) -> EngineStream:
        """Queue the request in the engine — after pulling its prefix from the route's KV source
        when it names one and the KV does not come from a prefill node (node/kv_pull.py); a
        request the engine refuses is the client's 400 (EngineOverloaded and EngineDead
        propagate: the app answers 503)."""
        source, rk = self.prep.body.kv_source, self.node.remote_kv
        if source is not None and rk is not None and not (handoff and handoff.remote_num_tokens):
            from node.kv_pull import PrefixPull

            return await PrefixPull(self, rk, source).start(params, handoff or KVHandoff())
        return await self.add(params, handoff)

    async def add(self, params: SamplingParams, handoff: KVHandoff | None = None) -> EngineStream:
        """Queue the request in the engine as it is (`start` without a pull)."""
        try:
            return await self.node.engine.add_request(
                self.engine_request_id, self.prep.prompt_ids, params, self.prep.priority, handoff
            )
        except RequestRefused as e:
            raise APIError(400, str(e)) from None
        finally:  # taken or refused, the node's next load frame is its answer to the route
            kv = self.request.app.get(KV_EVENTS)
            if kv is not None:
                kv.took(self.prep.request_id)

    async def respond(self, stream: EngineStream) -> web.StreamResponse:
        prep, model = self.prep, self.model
        if prep.body.stream:
            chunker: Chunker | None = None
            if prep.generate_id is not None:
                opts = prep.body.stream_options
                chunker = GenerateChunker(
                    prep.generate_id,
                    bool(opts and opts.include_usage),
                    prep.prompt_ids if prep.generate_prompt_ids else None,
                )
            elif prep.chat:
                opts = prep.body.stream_options
                chunker = ChatChunker(
                    prep.request_id, model, include_usage=opts is None or opts.include_usage
                )
            return await self._responder.stream(self.request, stream, model, chunker)
        return self.answer(await self.collect(stream))

    async def collect(self, stream: EngineStream) -> NodeCompletion:
        return await self._responder.collect(stream, self.model)

    @property
    def model(self) -> str:
        """The model the answer names: the LoRA adapter the request ran with, or the base."""
        return self.prep.params.lora_name or self.node.engine.model_name

    def answer(self, result: NodeCompletion) -> web.Response:
        body = chat_response(result) if self.prep.chat else result
        return web.Response(
            body=_ENC.encode(body),
            content_type="application/json",
            headers={"X-Request-Id": self.prep.request_id},
        )

    async def stream_error(self, err: APIError) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": self.prep.request_id})
        await resp.prepare(self.request)
        await end_stream(resp, error_event(err))
        return resp

    async def abort(self) -> None:
        await self._responder.abort()
