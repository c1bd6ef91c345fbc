"""NativeNodeEngine: this repo's engine (engine.AsyncEngine) behind the node seam.

The only node module that imports engine/. The engine's outputs are the interface's `Delta`s
(one class, protocol.outputs), passed on uncopied; the engine's exceptions become the
interface's (RequestError → RequestRefused, EngineOverloaded → EngineOverloaded,
EngineDeadError → EngineDead).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from engine import block_pool
from engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from engine.config import EngineConfig
from engine.core import EngineCore, RequestError
from engine.core import EngineOverloaded as CoreOverloaded
from engine.embed import Pooling
from engine.kv_tiers import Medium
from engine.lora import LoraError, LoraSlotsFull
from engine.sleep import EngineBusy as CoreBusy
from node.engine_api import (
    AdapterRefused,
    AdapterSlotsFull,
    BytesHash,
    Delta,
    EngineBusy,
    EngineDead,
    EngineOverloaded,
    HeldKV,
    KVCheck,
    KVEventDrain,
    KVHandoff,
    RequestRefused,
)
from protocol import kv_events as wire
from protocol.sampling import Priority, SamplingParams

#: seconds a client is told to wait after an overload answer
RETRY_AFTER_S = 1.0
_PLAIN = KVHandoff()


class NativeStream:
    """A RequestStream seen through the interface."""

    def __init__(self, stream: RequestStream) -> None:
        self._stream = stream
        self.request_id = stream.request_id
        self.prompt_token_ids = stream.prompt_token_ids
        self.reserved = None if stream.reserved is None else _translated(stream.reserved)

    @property
    def num_cached_blocks(self) -> int:
        return self._stream.num_cached_blocks

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[Delta]:
        try:
            async for out in self._stream:
                yield out  # the engine's RequestOutput is the interface's Delta
        except EngineDeadError as e:
            raise EngineDead(str(e)) from e


def _translated(inner: asyncio.Future[list[int]]) -> asyncio.Future[list[int]]:
    """A future that mirrors `inner`, with the engine's death as the interface's EngineDead."""
    outer: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()

    def copy(f: asyncio.Future[list[int]]) -> None:
        if outer.done():
            return
        if f.cancelled():
            outer.cancel()
        elif (e := f.exception()) is not None:
            outer.set_exception(EngineDead(str(e)) if isinstance(e, EngineDeadError) else e)
        else:
            outer.set_result(f.result())

    inner.add_done_callback(copy)
    return outer


class NativeNodeEngine:
    handles_kv_transfer = False

    def __init__(self, config: EngineConfig) -> None:
        from kvtransfer import allocate_pool

        # The pool is allocated the way the transport moves it fastest (huge pages on a host).
        self._engine = AsyncEngine(config, EngineCore(config, pool_factory=allocate_pool))
        core = self._engine.core
        self.model_name = core.model_name
        self.tokenizer = core.tokenizer
        self.max_model_len = core.max_model_len
        self.kv_layout = core.runner.kv_layout
        self.embedding_size = core.model_config.hidden_size
        self.max_loras = config.max_loras

    @property
    def async_engine(self) -> AsyncEngine:
        """The wrapped engine (tests and fault injection)."""
        return self._engine

    @property
    def dead(self) -> BaseException | None:
        return self._engine.dead

    def kv_memory(self) -> tuple[int, str]:
        pool = self._engine.core.runner.kv_cache
        return pool.data_ptr(), str(pool.device)

    def start(self, on_dead: Callable[[BaseException], None]) -> None:
        self._engine.start(on_dead)

    async def stop(self) -> None:
        await self._engine.stop()

    async def _call(self, coro: Any) -> Any:
        try:
            return await coro
        except EngineDeadError as e:
            raise EngineDead(str(e)) from e

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        handoff: KVHandoff | None = None,
    ) -> NativeStream:
        h = handoff or _PLAIN
        if h.kv_transfer_params is not None:  # the native legs move KV with kvtransfer
            raise RequestRefused("the native engine takes no kv_transfer_params (its legs move KV)")
        try:
            stream = await self._call(
                self._engine.add_request(
                    request_id,
                    prompt_token_ids,
                    params,
                    priority,
                    hold_blocks=h.hold_seconds is not None,
                    remote_num_tokens=h.remote_num_tokens,
                    hold_seconds=h.hold_seconds,
                )
            )
        except RequestError as e:
            raise RequestRefused(str(e)) from None
        except CoreOverloaded as e:
            raise EngineOverloaded(str(e), RETRY_AFTER_S) from None
        return NativeStream(stream)

    async def embed(
        self, prompts: list[list[int]], pooling: str, dimensions: int | None = None
    ) -> list[bytes]:
        try:
            return await self._call(self._engine.embed(prompts, Pooling(pooling), dimensions))
        except RequestError as e:
            raise RequestRefused(str(e)) from None
        except CoreOverloaded as e:
            raise EngineOverloaded(str(e), RETRY_AFTER_S) from None

    # -- LoRA adapters and sleep mode (node.engine_api LoraEngine, SleepingEngine) ---------
    def lora_names(self) -> list[str]:
        return list(self._engine.lora_paths())

    def lora_paths(self) -> dict[str, str]:
        return self._engine.lora_paths()

    async def load_lora(self, name: str, path: str) -> list[str]:
        try:
            return await self._call(self._engine.load_lora(name, path))
        except LoraError as e:
            raise AdapterRefused(str(e)) from None
        except LoraSlotsFull as e:
            raise AdapterSlotsFull(str(e)) from None

    async def unload_lora(self, name: str) -> bool:
        try:
            return bool(await self._call(self._engine.unload_lora(name)))
        except LoraError as e:
            raise EngineBusy(str(e)) from None

    @property
    def is_sleeping(self) -> bool:
        return self._engine.sleeping

    @property
    def last_wake_s(self) -> float | None:
        return self._engine.core.last_wake_s

    @property
    def wakes(self) -> int:
        return self._engine.core.wakes

    async def sleep(self) -> None:
        try:
            await self._call(self._engine.sleep())
        except CoreBusy as e:
            raise EngineBusy(str(e)) from None

    async def wake_up(self) -> float:
        return float(await self._call(self._engine.wake_up()))

    async def abort(self, request_id: str) -> bool:
        return bool(await self._call(self._engine.abort(request_id)))

    async def held_kv(self, request_id: str) -> HeldKV | None:
        held = await self._call(self._engine.call(lambda core: core.held_kv(request_id)))
        return None if held is None else HeldKV(*held)

    async def release_held(self, request_id: str, block_ids: list[int] | None = None) -> int | None:
        try:
            return await self._call(self._engine.release_held(request_id, block_ids))
        except RequestError as e:
            raise RequestRefused(str(e)) from None

    async def kv_ready(
        self,
        request_id: str,
        ok: bool,
        quarantine: bool = False,
        digests: list[int | None] | None = None,
        where: str = "transfer",
        hashed: Mapping[int, BytesHash] | None = None,
    ) -> KVCheck:
        return await self._call(
            self._engine.kv_ready(request_id, ok, quarantine, digests, where, hashed)
        )

    async def release_quarantine(self, request_id: str) -> int:
        return int(await self._call(self._engine.release_quarantine(request_id)))

    async def share_prefix(
        self, share_id: str, block_hashes: list[int], cache_salt: str | None, lease_s: float
    ) -> HeldKV:
        try:
            blocks, digests = await self._call(
                self._engine.share(share_id, block_hashes, cache_salt, lease_s)
            )
        except RequestError as e:
            raise RequestRefused(str(e)) from None
        return HeldKV(blocks, digests)

    async def release_share(self, share_id: str, block_ids: list[int] | None = None) -> int | None:
        try:
            return await self._call(self._engine.release_share(share_id, block_ids))
        except RequestError as e:
            raise RequestRefused(str(e)) from None

    async def cached_block_hashes(self) -> list[int]:
        return await self._call(self._engine.call(lambda core: core.pool.cached_hashes()))

    async def drain_kv_events(self, snapshot: bool = False) -> KVEventDrain:
        drained = await self._call(self._engine.call(lambda core: _drain(core, snapshot)))
        # embedding work waiting counts as prompt tokens queued (the coordinator balances on it)
        drained.queued_prefill_tokens += self._engine.queued_embed_tokens
        return drained

    def stats(self) -> dict[str, float]:
        s = self._engine.stats()
        if self._engine.queued_embed_tokens:  # counted as prefill work, as drain_kv_events does
            s = {
                **s,
                "queued_prefill_tokens": s.get("queued_prefill_tokens", 0)
                + self._engine.queued_embed_tokens,
            }
        return s


def _drain(core: EngineCore, snapshot: bool) -> KVEventDrain:
    """On the engine thread, between two steps."""
    queued = core.scheduler.queued_prefill_tokens()
    tiers = core.tiers
    return KVEventDrain(
        events=[_wire_event(e) for e in core.pool.drain_events()],
        queued_prefill_tokens=queued,
        block_hashes=core.pool.cached_hashes() if snapshot else None,
        tiered_hashes={m.value: tiers.hashes(m) for m in Medium}
        if snapshot and tiers is not None
        else None,
    )


def _wire_event(ev: block_pool.KVEvent) -> wire.KVEvent:
    """engine.block_pool's event dataclasses → the wire structs (same vLLM field names)."""
    if isinstance(ev, block_pool.BlockStored):
        return wire.BlockStored(
            block_hashes=list(ev.block_hashes),
            parent_block_hash=ev.parent_block_hash,
            token_ids=list(ev.token_ids),
            block_size=ev.block_size,
            medium=ev.medium,
        )
    if isinstance(ev, block_pool.BlockRemoved):
        return wire.BlockRemoved(block_hashes=list(ev.block_hashes), medium=ev.medium)
    return wire.AllBlocksCleared()
