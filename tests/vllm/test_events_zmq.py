"""The KV-events bridge against vLLM's real ZMQ publisher (vllm.distributed.kv_events): what
vLLM publishes arrives as duet events with duet's hashes; a lost batch (a gap in vLLM's
sequence numbers) becomes AllBlocksCleared. Needs vLLM (skipped without it; .ci/run runs it in its
vLLM stage)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from protocol.block_hash import block_hashes
from protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tests.wait import until


async def test_bridge_reads_vllms_publisher(need_vllm: None, tmp_path: Path) -> None:
    from vllm.distributed.kv_events import AllBlocksCleared as VCleared
    from vllm.distributed.kv_events import BlockRemoved as VRemoved
    from vllm.distributed.kv_events import BlockStored as VStored
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    from node.engines.vllm_events import VllmEventBridge

    endpoint = f"ipc://{tmp_path}/kv-{uuid.uuid4().hex[:6]}"
    pub = ZmqEventPublisher(0, endpoint=endpoint, topic="kv")
    bridge = VllmEventBridge(endpoint, 16)
    tokens = list(range(500, 564))
    want = block_hashes(tokens, 16)
    got: list = []

    def stored(hashes: list[bytes], parent: bytes | None, toks: list[int]) -> VStored:
        return VStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=toks,
            block_size=32,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )

    async def reader() -> None:
        async for events in bridge:
            got.extend(events)

    task = asyncio.create_task(reader())
    try:
        # ZMQ's slow joiner: publish a probe until the subscriber sees it.
        deadline = asyncio.get_running_loop().time() + 30
        while not got:
            pub.publish(KVEventBatch(ts=0.0, events=[VCleared()]))
            assert asyncio.get_running_loop().time() < deadline, "the bridge never connected"
            await asyncio.sleep(0.05)
        got.clear()
        pub.publish(KVEventBatch(ts=1.0, events=[stored([b"a" * 32], None, tokens[:32])]))
        pub.publish(
            KVEventBatch(
                ts=2.0,
                events=[
                    stored([b"b" * 32], b"a" * 32, tokens[32:]),
                    VRemoved(block_hashes=[b"b" * 32], medium="CPU"),
                ],
            )
        )
        await until(lambda: len(got) >= 3, 30, "three events through the bridge")
        assert got[0] == BlockStored(
            block_hashes=want[:2], parent_block_hash=None, token_ids=tokens[:32], block_size=16
        )
        assert got[1] == BlockStored(
            block_hashes=want[2:], parent_block_hash=want[1], token_ids=tokens[32:], block_size=16
        )
        assert got[2] == BlockRemoved(block_hashes=want[2:])
        assert sorted(bridge.translator.cached_hashes()) == sorted(want[:2])
        # A gap in vLLM's sequence numbers: everything is announced cleared.
        next(pub._seq_gen)
        pub.publish(KVEventBatch(ts=3.0, events=[]))
        await until(lambda: len(got) >= 4, 30, "AllBlocksCleared after the gap")
        assert got[3] == AllBlocksCleared() and bridge.translator.cached_hashes() == []
    finally:
        task.cancel()
        bridge.close()
        pub.shutdown()
