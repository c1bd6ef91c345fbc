"""The seam between a node's HTTP layer and its engine (DESIGN §3).

The node only ever talks to a `NodeEngine`: add/stream/abort, the P/D hooks and counters.
`NativeNodeEngine` adapts this repo's AsyncEngine; a vLLM-backed engine implements the same
protocol and the HTTP layer does not change.
"""

from __future__ import annotations

from typing import Protocol

from engine.async_engine import AsyncEngine, RequestStream
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.request import Priority
from engine.sampling_params import SamplingParams
from protocol.kv_layout import KVLayout
from protocol.tokenizer import Tokenizer


class NodeEngine(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    kv_layout: KVLayout
    dead: BaseException | None

    def kv_memory(self) -> tuple[int, str]:
        """(base address, device) of the KV pool, for the transport to register."""
        ...

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: Priority = ..., hold_blocks: bool = ...,
                          remote_num_tokens: int = ...) -> RequestStream: ...  # fmt: skip

    async def abort(self, request_id: str) -> bool: ...

    async def release(self, request_id: str) -> bool: ...

    async def held_blocks(self, request_id: str) -> list[int] | None: ...

    async def kv_ready(self, request_id: str, ok: bool) -> bool: ...

    def stats(self) -> dict[str, float]: ...


class NativeNodeEngine(AsyncEngine):
    """This repo's engine behind the node seam."""

    def __init__(self, config: EngineConfig) -> None:
        from kvtransfer import allocate_pool

        # The pool is allocated the way the transport moves it fastest (huge pages on a host).
        super().__init__(config, EngineCore(config, pool_factory=allocate_pool))
        self.model_name = self.core.model_name
        self.tokenizer = self.core.tokenizer
        self.max_model_len = self.core.max_model_len
        self.kv_layout = self.core.runner.kv_layout

    def kv_memory(self) -> tuple[int, str]:
        pool = self.core.runner.kv_cache
        return pool.data_ptr(), str(pool.device)

    async def held_blocks(self, request_id: str) -> list[int] | None:
        return await self.call(lambda core: core.held_blocks(request_id))
