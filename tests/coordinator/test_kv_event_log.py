"""The node's KV event log on a real engine: numbered batches without gaps, a snapshot that
names the batch it includes, a bounded ring, and wire frames that round-trip."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import msgspec

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from node.busy_window import BusyWindow
from node.engines.native import NativeNodeEngine
from node.kv_events import KVEventLog
from protocol.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    FrameDecoder,
    LoadFrame,
    encode_frame,
)

ONE = SamplingParams(max_tokens=1, temperature=0)


async def run(engine: AsyncEngine, rid: str, prompt: list[int]) -> None:
    async for _ in await engine.add_request(rid, prompt, ONE):
        pass


async def test_batches_snapshot_and_ring(tiny_llama: Path) -> None:
    # 8 blocks of 16 tokens: the third 48-token prompt evicts the first one's blocks.
    node_engine = NativeNodeEngine(
        EngineConfig(
            model=str(tiny_llama),
            dtype="float32",
            num_kv_blocks=8,
            max_model_len=128,
            record_kv_events=True,
        )
    )
    engine = node_engine.async_engine
    engine.start()
    try:
        log = KVEventLog(node_engine, "e1", 16, recording=True, ring_size=2)
        snap = await log.snapshot()
        assert (snap.seq, snap.block_hashes) == (0, [])
        for i in range(3):
            await run(engine, f"r{i}", [(i * 50 + k) % 380 + 1 for k in range(49)])
            await log.poll()
        assert log.seq == 3  # one batch per drain that found events
        assert log.after(0) is None  # batch 1 left the 2-batch ring: the reader must resync
        kept = log.after(1)
        assert [b.seq for b in kept] == [2, 3] and log.after(3) == [] and log.after(4) is None
        events = [e for b in kept for e in b.events]
        assert any(isinstance(e, BlockRemoved) for e in events)
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        snap = await log.snapshot()
        assert snap.seq == 3 and set(stored[-3:]) <= set(snap.block_hashes)
        real = await engine.call(lambda core: set(core.pool.cached_hashes()))
        assert set(snap.block_hashes) == real

        # Frames round-trip through the length-prefixed msgpack encoding, split anywhere.
        enc = msgspec.msgpack.Encoder()
        log.took("r0")
        load = log.load(engine.stats(), log.seq, log.taken_since(0))
        wire = b"".join(encode_frame(enc, f) for f in [*kept, load])
        dec = FrameDecoder()
        frames = [f for i in range(0, len(wire), 7) for f in dec.feed(wire[i : i + 7])]
        assert frames == [*kept, load]
        assert isinstance(frames[-1], LoadFrame) and frames[-1].kv_blocks_total == 8
        assert frames[-1].taken == ["r0"] and log.taken_since(1) == []
        assert all(isinstance(f, EventBatch) for f in frames[:-1])
    finally:
        await engine.stop()


async def test_the_frame_that_acks_a_request_counts_its_prompt_tokens(tiny_llama: Path) -> None:
    """A load frame built once the node took a request (the frame that ends the coordinator's
    reservation for it) counts its prompt tokens, though the engine is inside the step after it
    and no drain has run since (the drain waits for the step: up to a second for a long chunk)."""
    node_engine = NativeNodeEngine(
        EngineConfig(
            model=str(tiny_llama),
            dtype="float32",
            num_kv_blocks=16,
            max_model_len=128,
            record_kv_events=True,
        )
    )
    engine = node_engine.async_engine
    engine.start()
    gate, entered = threading.Event(), threading.Event()
    real = engine.core.step

    def held_step():
        entered.set()
        assert gate.wait(30)
        return real()

    try:
        log = KVEventLog(node_engine, "e1", 16, recording=True)
        await log.poll()
        engine.core.step = held_step
        stream = await engine.add_request("r0", list(range(3, 53)), ONE)
        log.took("r0")
        assert await asyncio.to_thread(entered.wait, 30)
        frame = log.load(node_engine.stats(), log.seq, log.taken_since(0))
        assert frame.taken == ["r0"]
        assert (
            frame.queued_prefill_tokens == 50
            and frame.num_requests_waiting + frame.num_requests_running == 1
        )
        gate.set()
        async for _ in stream:
            pass
    finally:
        gate.set()
        engine.core.step = real
        await engine.stop()


async def test_load_frames_carry_the_engines_busy_fraction(tiny_llama: Path) -> None:
    """The frame's `busy` is the engine thread's share of the recent wall time in steps (the
    planner's n − 1 test for prefill pools): None until two frames span `min_span_s`, then
    within 0..1 and above 0 once requests ran, measured from the engine's own step timing."""
    node_engine = NativeNodeEngine(
        EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64, max_model_len=128)
    )
    engine = node_engine.async_engine
    engine.start()
    try:
        log = KVEventLog(node_engine, "e1", 16, recording=False)
        log.busy = BusyWindow(min_span_s=0.0)

        def busy_s(stats: dict[str, float]) -> float:
            return stats["engine_step_seconds"] + stats["engine_step_gap_seconds"]

        s1 = node_engine.stats()
        a1 = time.monotonic()
        assert log.load(s1, 0, []).busy is None  # one sample spans nothing
        b1 = time.monotonic()
        for i in range(8):
            await run(engine, f"r{i}", list(range(3, 90)))
        s2 = node_engine.stats()
        a2 = time.monotonic()
        frame = log.load(s2, 0, [])
        b2 = time.monotonic()
        worked = busy_s(s2) - busy_s(s1)
        assert worked > 0 and frame.busy is not None
        # the engine's step (and between-step) seconds over the time between the two frames
        assert worked / (b2 - a1) - 1e-9 <= frame.busy <= min(1.0, worked / (a2 - b1)) + 1e-9
        assert frame.busy > 0.0
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(frame), type=LoadFrame)
        assert wire.busy == frame.busy
    finally:
        await engine.stop()
