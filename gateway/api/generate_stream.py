"""A streamed `/inference/v1/generate` answer: the pipeline's `/v1/completions` stream (its
chunks carry their token ids: `return_token_ids`), rewritten in flight into vLLM's generate
stream — one `GenerateChunk` per completions chunk (the new token ids, their logprobs by token
id from the engine's records the legs were asked for, the finish reason), the usage chunk as
one with no choices, `[DONE]` last.

The request runs, reserves and bills exactly as the streamed completions request it is (the
pipeline's relay counts what it wrote; this sink only changes the words), so a client gone
mid-stream is billed for what was sent, like on `/v1/completions`. An error event passes
through as it is (OpenAI's error object, what vLLM's stream carries too). Invariant: every
token id the completions stream carried reaches the client once and in order.
"""

from __future__ import annotations

import msgspec

from gateway.serving.relay import EventSink
from protocol.generate import GenerateChoice, GenerateChunk, choice_logprobs
from protocol.openai import CompletionLogprobs, Usage
from protocol.sse import DONE, DataLines, sse


class _Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    token_ids: list[int] = []
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    #: on each choice's first chunk (the pipeline runs the request with return_token_ids)
    prompt_token_ids: list[int] | None = None


class _Chunk(msgspec.Struct, kw_only=True):
    """A completions stream chunk as this sink reads it (an error event has only `error`)."""

    choices: list[_Choice] = []
    usage: Usage | None = None
    error: msgspec.Raw | None = None


_CHUNK = msgspec.json.Decoder(_Chunk)


class GenerateSink:
    """An `EventSink` for the pipeline: reads the completions stream, writes generate's."""

    def __init__(self, inner: EventSink, request_id: str, prompt_ids: bool = False) -> None:
        self.inner = inner
        self.request_id = request_id
        #: the client asked for the prompt's ids (vLLM's `return_token_ids`): on the first event
        self.prompt_ids = prompt_ids
        self._lines = DataLines()

    @property
    def opened(self) -> bool:
        return self.inner.opened

    def could_wait(self, n: int) -> bool:
        return self.inner.could_wait(n)

    async def open(self, headers: dict[str, str]) -> None:
        await self.inner.open(headers)

    async def write(self, data: bytes) -> None:
        out = self._rewrite(data)
        if out:
            await self.inner.write(out)

    async def end(self, data: bytes) -> None:
        await self.inner.end(self._rewrite(data))

    def _rewrite(self, data: bytes) -> bytes:
        out: list[bytes] = []
        for payload in self._lines.feed(data):
            if payload == b"[DONE]":
                out.append(DONE)
                continue
            chunk = _CHUNK.decode(payload)
            if chunk.error is not None:  # OpenAI's error event, as vLLM's stream carries it
                out.append(b"data: " + payload + b"\n\n")
                continue
            choices = [
                GenerateChoice(
                    index=c.index,
                    token_ids=c.token_ids,
                    finish_reason=c.finish_reason,
                    logprobs=choice_logprobs(c.logprobs),
                )
                for c in chunk.choices
                if c.token_ids or c.finish_reason  # vLLM sends no chunk without either
            ]
            if choices or chunk.usage is not None:
                event = GenerateChunk(
                    request_id=self.request_id, choices=choices, usage=chunk.usage
                )
                prompt = next(
                    (c.prompt_token_ids for c in chunk.choices if c.prompt_token_ids), None
                )
                if self.prompt_ids and prompt is not None:
                    event.prompt_token_ids, self.prompt_ids = prompt, False
                out.append(sse(event))
        return b"".join(out)
