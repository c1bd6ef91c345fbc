"""One leg of a request on one node: the node request it sends (`leg_request`, from the client's
request, the attempt and the leg's own `LegFields`), the stream a decode (or local) leg reads
(`NodeStream`, with the node's load counted while it runs), and a decode leg once started
(`DecodeLeg`).

A leg's request carries the prompt's ids, the client's sampling fields (penalties, logit_bias
and the guide included: the same on P and D), the tier as the node's priority, the caller's
cache domain, and the leg's own fields: whether it streams, its max_tokens and seed, the KV
handle it sends or was given, and — on a migrated leg — where the output resumes. A field a
leg must pass on to a node (a KV source, an adapter) is added here, in one place.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any

from gateway.backends.base import Attempt
from gateway.backends.node_client import NodeClient, NodeFailure
from gateway.backends.routing import NodeLoad
from gateway.serving.requests import Request
from protocol.kv_params import KVTransferParams
from protocol.node_api import NodeCompletionChunk, NodeCompletionRequest
from protocol.resume import Resume
from protocol.route import KVSource, RouteRequest

#: the prefill leg asks P to compute the prompt and hold its KV for a decode node
TO_DECODE = KVTransferParams(do_remote_decode=True)
#: a chunk read from a node stream, and whether the next one has arrived already
Chunk = tuple[NodeCompletionChunk, bool]
#: what a sample's stream puts on the n > 1 fan-out's queue: a chunk, its failure, or its end
Item = tuple[int, NodeCompletionChunk | BaseException | None]


@dataclass(frozen=True)
class LegFields:
    """A leg's own fields (the rest of its request is the client's and the attempt's)."""

    stream: bool
    max_tokens: int
    #: the sample's seed (sample i > 0 draws from the request's seed + i)
    seed: int | None
    #: the logprobs the leg reports (None: none; a prefill leg's come from D)
    logprobs: int | None
    kv_transfer_params: KVTransferParams | None = None
    resume: Resume | None = None
    #: the node holding the prompt's prefix that the node computing the prompt pulls it from
    kv_source: KVSource | None = None


def leg_request(request: Request, attempt: Attempt, leg: LegFields) -> NodeCompletionRequest:
    """The node request of one leg."""
    s = request.sampling
    return NodeCompletionRequest(
        # a LoRA adapter's legs name it, as vLLM's requests do; the base model's name none
        model=attempt.model.adapter,
        prompt=attempt.prompt_ids,
        max_tokens=leg.max_tokens,
        priority=attempt.tier,
        temperature=s.temperature,
        top_p=s.top_p,
        seed=leg.seed,
        top_k=s.top_k,
        ignore_eos=bool(s.ignore_eos),
        min_tokens=s.min_tokens or 0,
        stop=list(s.stop) or None,
        logprobs=leg.logprobs,
        cache_salt=attempt.cache_domain or None,
        frequency_penalty=s.frequency_penalty,
        presence_penalty=s.presence_penalty,
        repetition_penalty=s.repetition_penalty,
        min_p=s.min_p,
        logit_bias=s.logit_bias,
        guide=attempt.guide,
        stream=leg.stream,
        kv_transfer_params=leg.kv_transfer_params,
        resume=leg.resume,
        kv_source=leg.kv_source,
        retain=attempt.retain,
        logprob_records=request.logprob_records and leg.logprobs is not None,
    )


def route_request(attempt: Attempt, hashes: list[int], exclude: list[str]) -> RouteRequest:
    """What the coordinator is asked for one leg: the model, the prompt's block hashes (the
    caller's domain is their root), its size, the tier, the nodes excluded, and the LoRA
    adapter it runs with (the coordinator routes it to nodes holding it, or loads it there)."""
    m = attempt.model
    return RouteRequest(
        model=m.cluster_name,
        block_hashes=hashes,
        num_prompt_tokens=len(attempt.prompt_ids),
        max_tokens=attempt.max_tokens,
        tier=attempt.tier,
        exclude=list(exclude),
        request_id=attempt.request_id,
        lora_name=m.adapter,
        lora_path=m.adapter_path,
    )


class NodeStream:
    """One node stream (one sample) on one node, with its load counted while it runs."""

    def __init__(
        self,
        nodes: NodeClient,
        load: NodeLoad,
        url: str,
        request_id: str,
        index: int,
        body: NodeCompletionRequest,
    ) -> None:
        self.nodes, self.load = nodes, load
        self.url = url
        self.request_id = request_id
        self.index = index
        self.body = body
        self._it: AsyncIterator[Chunk] | None = None
        self._counted = False

    def _open(self) -> AsyncIterator[Chunk]:
        self.load.acquire(self.url)
        self._counted = True
        return self.nodes.stream(self.url, self.request_id, self.body)

    def _close_count(self) -> None:
        if self._counted:
            self._counted = False
            self.load.release(self.url)

    async def start(self) -> Chunk:
        """Open the stream and read up to the first chunk that carries tokens."""
        self._it = self._open()
        try:
            async for chunk, more in self._it:
                if any(c.token_ids or c.finish_reason for c in chunk.choices):
                    return chunk, more
            raise NodeFailure(self.url, "stream ended without a token")
        except BaseException:
            self._close_count()
            raise

    async def chunks(self, head: Chunk | None) -> AsyncGenerator[Chunk, None]:
        """`head` (what start() read), then the rest of the stream; the node's load is
        released and the stream closed however this ends."""
        try:
            if head is not None:
                yield head
            if self._it is None:
                self._it = self._open()
            async for item in self._it:
                yield item
        finally:
            self._close_count()
            aclose = getattr(self._it, "aclose", None)
            if aclose is not None:
                await aclose()

    async def pump(self, queue: asyncio.Queue[Item], head: Chunk | None) -> None:
        """The stream's chunks onto the fan-out's queue, then its end (or its failure)."""
        try:
            async for chunk, _ in self.chunks(head):
                await queue.put((self.index, chunk))
            await queue.put((self.index, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            await queue.put((self.index, e))


@dataclass(frozen=True)
class DecodeLeg:
    """A decode leg once started: its node, its stream (on the node's URL, under the leg's
    request id), the first chunk read, and its span (None when tracing is off)."""

    node_id: str
    stream: NodeStream
    head: Chunk
    span: Any = None

    @property
    def url(self) -> str:
        return self.stream.url

    @property
    def request_id(self) -> str:
        return self.stream.request_id

    def chunks(self) -> AsyncGenerator[Chunk, None]:
        return self.stream.chunks(self.head)
