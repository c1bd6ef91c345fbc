"""The engine interface: the only thing node code knows about an engine (DESIGN §3).

Engines (node/engines/: `native` today, `vllm` later) adapt themselves to `NodeEngine`; the HTTP
layer, the prefill and decode legs and the metrics use nothing else. Nothing here imports an
engine (a test enforces it), so a second engine slots in without touching the HTTP layer.

Contract:
- `add_request` queues a request and returns its `EngineStream`: `Delta`s until one with
  `finished`; a request that fails inside the engine ends with finish_reason "error" and
  `error` set (other requests are unaffected); if the whole engine dies the stream raises
  `EngineDead`.
- Refusals are typed: `RequestRefused` (the client's fault → 400), `EngineOverloaded` (the
  queue is full → 503 with Retry-After), `EngineDead` (→ 503).
- P/D hooks: `add_request`'s `KVHandoff`, and the calls below. Prefill: `hold_seconds` keeps
  a finished request's blocks for that long, atomically with its finishing (the engine frees
  them itself when the time is up); `held_kv` names them with their content digests
  (protocol/kv_digest.py); `release_held` frees
  them early (None: nothing held); `abort` also frees held blocks. Decode: `remote_num_tokens`
  makes the engine reserve blocks first (`EngineStream.reserved`), then wait for `kv_ready`,
  which checks the blocks against the sender's digests before the KV counts (`KVCheck`);
  `quarantine=True` sets the blocks a failed transfer may still write aside until
  `release_quarantine`.
- An engine with `handles_kv_transfer` (vLLM) moves KV itself: the legs pass the client's
  `kv_transfer_params` (typed, `KVHandoff.kv_transfer_params`) to `add_request` and answer with
  the finishing delta's; the hooks above then hold nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from protocol.kv_digest import BytesHash, KVCheck
from protocol.kv_events import KVEvent
from protocol.kv_layout import KVLayout
from protocol.kv_params import KVTransferParams
from protocol.outputs import RequestOutput
from protocol.sampling import Priority, SamplingParams
from text.tokenizer import Tokenizer

__all__ = [
    "AdapterRefused",
    "AdapterSlotsFull",
    "BytesHash",
    "Delta",
    "EmbeddingEngine",
    "EngineBusy",
    "EngineDead",
    "EngineOverloaded",
    "EngineStream",
    "HeldKV",
    "KVCheck",
    "KVEventDrain",
    "KVHandoff",
    "LoraEngine",
    "NodeEngine",
    "Priority",
    "RequestRefused",
    "SamplingParams",
    "SleepingEngine",
]


class RequestRefused(ValueError):
    """The engine refuses this request as given (the client's error: 400)."""


class EngineOverloaded(RuntimeError):
    """The engine's queue is full; retry after `retry_after` seconds or on another node (503)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineDead(RuntimeError):
    """The engine failed as a whole; the node must be restarted (503 until then)."""


class AdapterRefused(ValueError):
    """A LoRA adapter the engine will not load as asked (unreadable, or not applicable: 400)."""


class AdapterSlotsFull(RuntimeError):
    """Every LoRA slot holds an adapter requests use: retry later or elsewhere (503)."""


class EngineBusy(RuntimeError):
    """A state change (sleep, unloading an adapter) asked while requests need the state (409)."""


#: What one engine step produced for one request: the engine's own output record, reused as is
#: (protocol.outputs; the native adapter passes the engine's outputs through uncopied).
Delta = RequestOutput


@dataclass(frozen=True)
class KVHandoff:
    """A request's part in a P/D handoff (`add_request`; None: a plain request)."""

    #: prefill: keep the finished request's blocks this long (native engine)
    hold_seconds: float | None = None
    #: decode: reserve blocks for this many remote prompt tokens, then wait for `kv_ready`
    remote_num_tokens: int = 0
    #: an engine that moves KV itself (`handles_kv_transfer`): the vLLM-named params to pass on
    kv_transfer_params: KVTransferParams | None = None


@dataclass(frozen=True)
class HeldKV:
    """What a prefill node holds for one request: its blocks, in order, and their content
    digests (None: an engine that takes none)."""

    block_ids: list[int]
    digests: list[int] | None = None


@dataclass
class KVEventDrain:
    """One consistent view between two engine steps (for the coordinator's event stream):
    the prefix-cache events since the last drain, the prompt tokens still to compute, and,
    when asked, every cached block hash."""

    events: list[KVEvent]
    queued_prefill_tokens: int
    block_hashes: list[int] | None = None
    #: with a snapshot: the blocks in the spill tiers, by medium ("host", "disk")
    tiered_hashes: dict[str, list[int]] | None = None


class EngineStream(Protocol):
    request_id: str
    prompt_token_ids: list[int]
    #: decode node: resolves to the local block ids reserved for the remote KV
    reserved: asyncio.Future[list[int]] | None

    @property
    def num_cached_blocks(self) -> int:
        """Decode node: leading reserved blocks served by the local prefix cache (not pulled)."""
        ...

    def __aiter__(self) -> AsyncIterator[Delta]: ...


class NodeEngine(Protocol):
    model_name: str
    tokenizer: Tokenizer
    max_model_len: int
    kv_layout: KVLayout
    #: True for an engine that moves KV between nodes itself (vLLM's NixlConnector): the node
    #: then passes `kv_transfer_params` through `add_request` and runs no transport of its own
    handles_kv_transfer: bool

    @property
    def dead(self) -> BaseException | None: ...

    def kv_memory(self) -> tuple[int, str]:
        """(base address, device) of the KV pool, for the transport to register."""
        ...

    def start(self, on_dead: Callable[[BaseException], None]) -> None: ...

    async def stop(self) -> None: ...

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.INTERACTIVE,
        handoff: KVHandoff | None = None,
    ) -> EngineStream: ...

    async def abort(self, request_id: str) -> bool: ...

    async def held_kv(self, request_id: str) -> HeldKV | None: ...

    async def release_held(
        self, request_id: str, block_ids: list[int] | None = None
    ) -> int | None: ...

    async def kv_ready(
        self,
        request_id: str,
        ok: bool,
        quarantine: bool = False,
        digests: list[int | None] | None = None,
        where: str = "transfer",
        hashed: Mapping[int, BytesHash] | None = None,
    ) -> KVCheck:
        """The transfer into a reserved request's blocks ended; `digests` (aligned with its
        blocks, None for one not transferred) are the sender's, checked before the KV counts;
        `where` names the source in the engine's counters ("transfer" or "peer"). `hashed`: the
        blocks' bytes as hashed when they landed (kvtransfer/hashed_read.py), by block id; the
        engine binds and checks those instead of hashing the blocks again."""
        ...

    async def release_quarantine(self, request_id: str) -> int: ...

    async def share_prefix(
        self, share_id: str, block_hashes: list[int], cache_salt: str | None, lease_s: float
    ) -> HeldKV:
        """Hold the leading blocks of `block_hashes` this node has (pool or spill tiers) for a
        peer's pull until `release_share` or `lease_s` seconds; none held: empty block ids.
        An engine that cannot share answers none."""
        ...

    async def release_share(self, share_id: str, block_ids: list[int] | None = None) -> int | None:
        """Free a share (None: nothing held; RequestRefused: the ids are not its own)."""
        ...

    async def cached_block_hashes(self) -> list[int]: ...

    async def drain_kv_events(self, snapshot: bool = False) -> KVEventDrain:
        """Take the KV events recorded since the last call (record_kv_events on) — with every
        cached hash when `snapshot`, atomically with the drain."""
        ...

    def stats(self) -> dict[str, float]: ...


@runtime_checkable
class EmbeddingEngine(Protocol):
    """An engine that also serves embeddings (`--task embed`; the native one does): prefill
    only, pooled and L2-normalized, batched across callers. Refusals as `add_request`'s."""

    #: components of a full vector (the model's hidden size)
    embedding_size: int

    async def embed(
        self, prompts: list[list[int]], pooling: str, dimensions: int | None = None
    ) -> list[bytes]:
        """One vector per prompt, in order: `dimensions` (None: all) little-endian float32."""
        ...


@runtime_checkable
class LoraEngine(Protocol):
    """An engine that serves LoRA adapters loaded at run time (the native one with max_loras >
    0). A request runs with an adapter when its `model` is the adapter's name."""

    #: slots for resident adapters (0: LoRA off)
    max_loras: int

    def lora_names(self) -> list[str]: ...

    def lora_paths(self) -> dict[str, str]:
        """name → the directory each resident adapter was loaded from."""
        ...

    async def load_lora(self, name: str, path: str) -> list[str]:
        """Returns the adapters unloaded to make room; AdapterRefused / AdapterSlotsFull."""
        ...

    async def unload_lora(self, name: str) -> bool:
        """False: not loaded; EngineBusy while requests use it."""
        ...


@runtime_checkable
class SleepingEngine(Protocol):
    """An engine with vLLM's sleep mode: weights and KV pool released while idle, rebuilt by
    `wake_up` or by the next request."""

    @property
    def is_sleeping(self) -> bool: ...

    @property
    def last_wake_s(self) -> float | None: ...

    async def sleep(self) -> None:
        """EngineBusy while the engine holds requests."""
        ...

    async def wake_up(self) -> float:
        """Seconds the wake took (0 when awake already)."""
        ...
