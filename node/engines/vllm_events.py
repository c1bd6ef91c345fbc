"""The vLLM KV-events bridge: vLLM's ZMQ KV-event stream → duet's KV events (DESIGN §4).

vLLM publishes prefix-cache changes (`kv_events_config`, ZMQ PUB: frames `topic, seq (u64 big
endian), msgpack(EventBatch)`) with its *own* block hashes (sha256 or its builtin hash, seeded
per process). The coordinator's index and the gateway speak duet's hashes (protocol.block_hash),
so the bridge recomputes them from each event's token ids:

    duet(block) = hash_block(duet(parent), tokens of the block)

and a prompt's first block chains from its cache domain's root (`domain_root(cache_salt)`,
DESIGN §8), the salt read off the event's `extra_keys` (vLLM publishes the request's
`cache_salt` there for the first block), so the index holds the same salted hashes the gateway
routes with.

keeping a map vLLM hash → duet hashes for every cached block (a vLLM block may hold several
duet blocks: vLLM's CPU attention needs blocks of 32 tokens, duet hashes 16), so `BlockRemoved` and
the parents of later `BlockStored` events translate too, and the map's values are the node's
snapshot.

Invariants:
- only blocks whose whole chain is known are announced: a `BlockStored` whose parent the bridge
  never saw (events lost) or whose tokens are not whole blocks is dropped, never guessed — the
  index may miss a block, never claim one the node does not have;
- a gap in vLLM's sequence numbers (the PUB socket dropped frames) resets everything: the bridge
  emits `AllBlocksCleared` and forgets its map, so readers never keep stale blocks.

`translate` is pure (unit-tested without vLLM); `VllmEventBridge` owns the ZMQ socket and is an
async iterator of duet events. The decoder here is our own copy of vLLM's wire schema (tagged
msgpack maps inside an array-like batch), so this module never imports vLLM.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec

from protocol.block_hash import DEFAULT_HASH_SEED, domain_root, hash_block
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger("duet.node")

VllmHash = int | bytes


class VStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None
    token_ids: list[int]
    block_size: int
    #: per block, the extra keys of its hash (untagged): the first block's hold the request's
    #: cache_salt (a string; duet serves no LoRA, whose name would be a string too)
    extra_keys: list[list[Any] | None] | None = None

    def cache_salt(self) -> str | None:
        first = self.extra_keys[0] if self.extra_keys else None
        return next((k for k in first or () if isinstance(k, str)), None)


class VRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[VllmHash]


class VCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


VEvent = VStored | VRemoved | VCleared


class VBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[VEvent]
    data_parallel_rank: int | None = None


class HashTranslator:
    """vLLM events → duet events, with the vLLM → duet hash map (see module docstring).

    `block_size` is duet's hash block (the gateway's and the coordinator's unit); vLLM's blocks
    may be a multiple of it (vLLM's CPU attention needs multiples of 32): each vLLM block then
    stands for several duet blocks, announced and removed together."""

    def __init__(self, block_size: int, seed: int = DEFAULT_HASH_SEED) -> None:
        self.block_size = block_size
        self.seed = seed
        self._map: dict[VllmHash, list[int]] = {}
        #: BlockStored events dropped because their chain or tokens were unknown
        self.dropped = 0

    def cached_hashes(self) -> list[int]:
        """duet hashes of every block vLLM holds in its prefix cache (the snapshot)."""
        return [h for hs in self._map.values() for h in hs]

    def reset(self) -> list[KVEvent]:
        self._map.clear()
        return [AllBlocksCleared()]

    def translate(self, events: Iterable[VEvent]) -> list[KVEvent]:
        out: list[KVEvent] = []
        for ev in events:
            if isinstance(ev, VStored):
                stored = self._stored(ev)
                if stored is not None:
                    out.append(stored)
            elif isinstance(ev, VRemoved):
                gone = [h for v in ev.block_hashes for h in self._map.pop(v, ())]
                if gone:
                    out.append(BlockRemoved(block_hashes=gone))
            else:
                out.extend(self.reset())
        return out

    def _stored(self, ev: VStored) -> BlockStored | None:
        vbs, bs = ev.block_size, self.block_size
        n = len(ev.block_hashes)
        if vbs % bs or len(ev.token_ids) != n * vbs or n == 0:
            self.dropped += 1
            log.debug(
                "dropping a KV event with %d hashes, %d tokens, block size %d",
                n,
                len(ev.token_ids),
                vbs,
            )
            return None
        if ev.parent_block_hash is None:
            parent, duet_parent = domain_root(ev.cache_salt(), self.seed), None
        else:
            known = self._map.get(ev.parent_block_hash)
            if not known:  # we missed the parent's event: the chain cannot be recomputed
                self.dropped += 1
                return None
            parent = duet_parent = known[-1]
        hashes: list[int] = []
        for i, v in enumerate(ev.block_hashes):
            mine = []
            for start in range(i * vbs, (i + 1) * vbs, bs):
                parent = hash_block(parent, ev.token_ids[start : start + bs], self.seed)
                mine.append(parent)
            self._map[v] = mine
            hashes.extend(mine)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=duet_parent,
            token_ids=list(ev.token_ids),
            block_size=bs,
        )


_DECODER = msgspec.msgpack.Decoder(VBatch)


def decode_batch(payload: bytes) -> VBatch:
    return _DECODER.decode(payload)


class VllmEventBridge:
    """Subscribes to vLLM's KV-event publisher at `endpoint`; iterate it for duet events.

    `async for events in bridge` yields one list of duet events per vLLM batch (possibly empty
    when everything in it was dropped). Close with `close()`."""

    def __init__(
        self, endpoint: str, block_size: int, seed: int = DEFAULT_HASH_SEED, topic: str = "kv"
    ) -> None:
        import zmq
        import zmq.asyncio

        self.endpoint = endpoint
        self.translator = HashTranslator(block_size, seed)
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._last_seq: int | None = None

    def __aiter__(self) -> AsyncIterator[list[KVEvent]]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[list[KVEvent]]:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 3:
                log.warning(
                    "ignoring a KV event message of %d frames from %s", len(frames), self.endpoint
                )
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            out: list[KVEvent] = []
            if self._last_seq is not None and seq != self._last_seq + 1:
                log.warning(
                    "vLLM KV events %d..%d were lost: announcing a cleared cache",
                    self._last_seq + 1,
                    seq - 1,
                )
                out.extend(self.translator.reset())
            self._last_seq = seq
            try:
                batch = decode_batch(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.warning("undecodable vLLM KV event batch (%s): announcing a cleared cache", e)
                out.extend(self.translator.reset())
                yield out
                continue
            out.extend(self.translator.translate(batch.events))
            yield out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._sock.close(0)
        with contextlib.suppress(Exception):
            self._ctx.term()
