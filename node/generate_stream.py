"""A node's streamed `/inference/v1/generate` answer (vLLM's generate stream): each engine
delta with new token ids or a finish reason is one `GenerateChunk` (the ids, their logprobs by
token id when asked, the finish reason), and with `stream_options.include_usage` a last
chunk with no choices carries the usage — the same tokens the node's streamed `/v1/completions`
carries for the same prompt ids (node/responder.py relays both, and ends with `[DONE]`).
"""

from __future__ import annotations

from node.engine_api import Delta
from protocol.generate import GenerateChoice, GenerateChunk, choice_logprobs
from protocol.openai import CompletionLogprobs, Usage


class GenerateChunker:
    """Renders a stream's deltas as generate chunks (a `node.responder.Chunker`)."""

    def __init__(
        self, request_id: str, include_usage: bool, prompt_ids: list[int] | None = None
    ) -> None:
        self.request_id = request_id
        self.include_usage = include_usage
        #: sent with the first event, then dropped (vLLM's `return_token_ids`; None: not asked)
        self.prompt_ids = prompt_ids

    def chunks(
        self,
        out: Delta,
        usage: Usage | None,
        timing: dict[str, float] | None,
        logprobs: CompletionLogprobs | None = None,
    ) -> list[GenerateChunk]:
        made: list[GenerateChunk] = []
        if out.new_token_ids or out.finish_reason:  # vLLM sends no chunk without either
            choice = GenerateChoice(
                index=0,
                token_ids=list(out.new_token_ids),
                finish_reason=out.finish_reason,
                logprobs=choice_logprobs(logprobs),
            )
            made.append(
                GenerateChunk(
                    request_id=self.request_id, choices=[choice], prompt_token_ids=self.prompt_ids
                )
            )
            self.prompt_ids = None
        if out.finished and self.include_usage and usage is not None:
            made.append(GenerateChunk(request_id=self.request_id, choices=[], usage=usage))
        return made
