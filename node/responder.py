"""Turns an engine EngineStream into the HTTP answer: OpenAI SSE (one JSON chunk per delta,
usage and timing in the last chunk, then `[DONE]`) or one JSON body.

Invariants: the engine request is aborted if the answer does not complete (client gone, write
failed, handler cancelled), so its blocks are freed; TTFT / ITL / e2e are observed once per
request on the node's histograms; once SSE headers are out, any failure (the request failed in
the engine, the engine died) is an SSE error event followed by `[DONE]`, never a second
response.

On a migrated leg (`resumed` > 0: the prompt's last `resumed` ids are output already streamed
by another node) the usage counts the original prompt and the new tokens only: the team is not
billed twice for what the first node made.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
from aiohttp import web

from node.engine_api import Delta, EngineDead, EngineStream
from node.logprobs import CompletionRenderer, PromptLogprobs, prompt_logprobs
from node.state import NodeState
from protocol.logprobs import TokenLogprob
from protocol.node_api import NodeCompletion, NodeCompletionChunk
from protocol.openai import APIError, CompletionChoice, CompletionLogprobs, Usage, usage
from protocol.outputs import Fault
from protocol.sse import SSE_HEADERS, end_stream, error_event, sse

log = logging.getLogger("duet.node")


def request_failed(out: Delta) -> APIError:
    """The engine failed this one request (its other requests go on). A failure that is the
    request's own (`Fault.REQUEST`: every node computes the same) is a 400, so no router
    computes it again elsewhere; the node's own is a 500 another node may not repeat."""
    if out.fault is Fault.REQUEST:
        return APIError(
            400,
            f"this request cannot be computed: {out.error}",
            type_="invalid_request_error",
            code="request_invalid",
        )
    return APIError(
        500,
        f"the engine failed this request: {out.error}",
        type_="engine_error",
        code="request_failed",
    )


def engine_dead(e: BaseException) -> APIError:
    return APIError(
        503,
        f"the engine failed; this node is restarting: {e}",
        type_="service_unavailable",
        code="engine_dead",
    )


class Chunker(Protocol):
    """Renders a stream's deltas as the chunks of another shape (chat's, generate's)."""

    def chunks(
        self,
        out: Delta,
        usage: Usage | None,
        timing: dict[str, float] | None,
        logprobs: CompletionLogprobs | None = None,
    ) -> Sequence[msgspec.Struct]: ...


class Responder:
    def __init__(
        self,
        state: NodeState,
        request_id: str,
        engine_request_id: str,
        arrival: float,
        resumed: int = 0,
        records: bool = False,
    ) -> None:
        self.state = state
        self.resumed = resumed
        self.request_id = request_id
        self.engine_request_id = engine_request_id
        self.arrival = arrival
        #: seconds since arrival: queue_s, ttft_s, total_s; decode legs add transfer_s and
        #: first_decode_s, prefill legs prefill_s
        self.timing: dict[str, float] = {}
        self._first_token_time: float | None = None
        self._last_token_time: float | None = None
        #: the logprobs carry the engine's records too (the leg's `logprob_records`)
        self._logprobs = CompletionRenderer(state.engine.tokenizer, records)
        self._created = int(time.time())

    def _usage(self, out: Delta) -> Usage:
        prompt = out.num_prompt_tokens - self.resumed
        return usage(prompt, out.num_output_tokens, min(out.num_cached_tokens, prompt))

    def logprobs(self, out: Delta) -> CompletionLogprobs | None:
        """This delta's logprobs in the completions shape (None: not asked for)."""
        return None if out.logprobs is None else self._logprobs.render(out.logprobs)

    def prompt_logprobs(self, out: Delta) -> PromptLogprobs | None:
        return (
            None
            if out.prompt_logprobs is None
            else prompt_logprobs(self.state.engine.tokenizer, out.prompt_logprobs)
        )

    def _observe(self, out: Delta) -> None:
        now = time.monotonic()
        m = self.state.metrics
        if out.new_token_ids:
            if self._last_token_time is None:
                self._first_token_time = now
                m.first_token(now - self.arrival)
            else:
                m.inter_token(now - self._last_token_time)
            self._last_token_time = now
        if out.finished:
            m.e2e.observe(now - self.arrival)
            self._finish_timing(out, now)

    def _finish_timing(self, out: Delta, now: float) -> None:
        t = self.timing
        t["total_s"] = now - self.arrival
        ttft = (self._first_token_time or now) - self.arrival
        t["ttft_s"] = ttft
        if "transfer_s" in t:  # decode leg: queue_s (until blocks were reserved) is set already
            t["first_decode_s"] = max(0.0, ttft - t.get("queue_s", 0.0) - t["transfer_s"])
        else:
            t["queue_s"] = _delta(out.arrival_time, out.first_scheduled_time)
            t["prefill_s"] = max(0.0, ttft - t["queue_s"])

    async def stream(
        self,
        request: web.Request,
        stream: EngineStream,
        model: str,
        chunker: Chunker | None = None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**SSE_HEADERS, "X-Request-Id": self.request_id})
        done = False
        try:
            await resp.prepare(request)
            try:
                done = await self._relay(resp, stream, model, chunker)
            except EngineDead as e:  # headers are out: the error goes in the stream
                await end_stream(resp, error_event(engine_dead(e)))
                done = True
        finally:
            if not done:
                await self.abort()
        return resp

    async def _relay(
        self,
        resp: web.StreamResponse,
        stream: EngineStream,
        model: str,
        chunker: Chunker | None,
    ) -> bool:
        async for out in stream:
            self._observe(out)
            if out.finish_reason == "abort" and self.state.draining:
                # The node is stopping (SIGTERM's grace period ran out: a drain deadline of a
                # scale-in, or an operator's stop) with this stream unfinished: an error event, not
                # a normal end, so the gateway migrates the stream to another node (the client's
                # answer goes on) instead of ending it with finish_reason "abort".
                await end_stream(
                    resp,
                    error_event(
                        APIError(
                            503,
                            "this node stopped before the answer ended "
                            "(drain deadline or shutdown); continue elsewhere",
                            type_="service_unavailable",
                            code="node_stopping",
                        )
                    ),
                )
                return True
            if out.error is not None:
                log.warning(
                    "request %s failed in the engine: %s", self.engine_request_id, out.error
                )
                await end_stream(resp, error_event(request_failed(out)))
                return True
            if chunker is not None:
                final = self._usage(out)
                timing = self.timing if out.finished else None
                for c in chunker.chunks(
                    out, final if out.finished else None, timing, self.logprobs(out)
                ):
                    await resp.write(sse(c))
                continue
            chunk = NodeCompletionChunk(
                id=self.request_id,
                created=self._created,
                model=model,
                choices=[
                    CompletionChoice(
                        text=out.new_text,
                        finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason,
                        token_ids=out.new_token_ids,
                        logprobs=self.logprobs(out),
                        prompt_logprobs=self.prompt_logprobs(out),
                    )
                ],
            )
            if out.finished:
                chunk.usage = self._usage(out)
                chunk.timing = self.timing
            await resp.write(sse(chunk))
        await end_stream(resp)
        return True

    async def collect(self, stream: EngineStream, model: str) -> NodeCompletion:
        text: list[str] = []
        tokens: list[int] = []
        final: Delta | None = None
        records: list[TokenLogprob] | None = None
        prompt: PromptLogprobs | None = None
        done = False
        try:
            try:
                async for out in stream:
                    self._observe(out)
                    text.append(out.new_text)
                    tokens.extend(out.new_token_ids)
                    if out.logprobs is not None:
                        records = (records or []) + out.logprobs
                    if out.prompt_logprobs is not None:
                        prompt = self.prompt_logprobs(out)
                    if out.finished:
                        final = out
            except EngineDead as e:
                raise engine_dead(e) from None
            done = True
        finally:
            if not done:
                await self.abort()
        assert final is not None
        if final.error is not None:
            log.warning("request %s failed in the engine: %s", self.engine_request_id, final.error)
            raise request_failed(final)
        return NodeCompletion(
            id=self.request_id,
            created=self._created,
            model=model,
            choices=[
                CompletionChoice(
                    text="".join(text),
                    finish_reason=final.finish_reason,
                    stop_reason=final.stop_reason,
                    token_ids=tokens,
                    logprobs=None if records is None else self._logprobs.render(records),
                    prompt_logprobs=prompt,
                )
            ],
            usage=self._usage(final),
            timing=self.timing,
            kv_transfer_params=final.kv_transfer_params,
        )

    async def abort(self) -> None:
        log.info("aborting %s (client gone or answer failed)", self.engine_request_id)
        with contextlib.suppress(Exception):
            await self.state.engine.abort(self.engine_request_id)


def _delta(a: float | None, b: float | None) -> float:
    return (b - a) if a is not None and b is not None else 0.0
