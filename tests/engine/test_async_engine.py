"""AsyncEngine: many coroutines on one engine thread, abort, errors, and the P/D hooks."""

import asyncio
import threading
from pathlib import Path

import pytest

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core import RequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
async def engine(tiny_llama: Path):
    e = AsyncEngine(EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=128))
    e.start()
    yield e
    await e.stop()


async def collect(
    e: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY
) -> list[int]:
    stream = await e.add_request(rid, prompt, params)
    toks: list[int] = []
    async for out in stream:
        toks += out.new_token_ids
    return toks


async def test_concurrent_requests_match_offline(engine: AsyncEngine, tiny_llama: Path) -> None:
    prompts = [[3 + i, 4 + i, 5 + i] * (i + 1) for i in range(12)]
    got = await asyncio.gather(*[collect(engine, f"r{i}", p) for i, p in enumerate(prompts)])
    want = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(prompts, GREEDY)]
    assert got == want


async def test_errors_reach_the_caller_and_the_engine_keeps_going(engine: AsyncEngine) -> None:
    with pytest.raises(RequestError, match="context"):
        await engine.add_request("long", [5] * 5000, GREEDY)
    await collect(engine, "dup", [5, 6])
    s = await engine.add_request("dup2", [5, 6], SamplingParams(max_tokens=500, ignore_eos=True))
    with pytest.raises(RequestError, match="already in use"):
        await engine.add_request("dup2", [5, 6], GREEDY)
    assert await engine.abort("dup2")
    outs = [o async for o in s]
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert len(await collect(engine, "after", [7, 8])) == 8


async def test_abort_frees_blocks(engine: AsyncEngine) -> None:
    s = await engine.add_request("a", [5] * 40, SamplingParams(max_tokens=1000, ignore_eos=True))
    async for out in s:
        if out.new_token_ids:
            break
    assert await engine.abort("a")
    free = await engine.call(lambda core: core.pool.num_free)
    assert free == 128


async def test_hold_release_and_remote_reserve(engine: AsyncEngine) -> None:
    # Prefill-node side: a held request keeps its blocks after finishing.
    s = await engine.add_request(
        "p", list(range(3, 40)), SamplingParams(max_tokens=1), hold_blocks=True
    )
    final = [o async for o in s][-1]
    assert final.finished and len(final.held_block_ids) == 3
    assert await engine.call(lambda core: core.held_blocks("p")) == final.held_block_ids
    assert await engine.release("p")
    assert not await engine.release("p")
    # Decode-node side: blocks are reserved first, then the request waits for kv_ready.
    s = await engine.add_request("d", list(range(3, 40)), GREEDY, remote_num_tokens=37)
    assert s.reserved is not None
    blocks = await asyncio.wait_for(s.reserved, 10)
    assert len(blocks) == 3
    assert await engine.kv_ready("d", ok=False)  # nothing arrived: the engine computes it all
    toks = [t async for o in s for t in o.new_token_ids]
    assert len(toks) == 8


async def test_abort_before_reservation_cancels_it(engine: AsyncEngine) -> None:
    # Two held prefills pin 126 of the 128 blocks, so a 20-block remote request must wait.
    for i in range(2):
        s = await engine.add_request(
            f"big{i}", [10 + i] * 1000, SamplingParams(max_tokens=1), hold_blocks=True
        )
        [o async for o in s]
    waiting = await engine.add_request("remote", [5] * 320, GREEDY, remote_num_tokens=320)
    assert waiting.reserved is not None and not waiting.reserved.done()
    assert await engine.abort("remote")
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting.reserved, 10)
    assert await engine.release("big0") and await engine.release("big1")


async def test_step_timing_counts_steps_and_only_busy_gaps(engine: AsyncEngine) -> None:
    """The engine thread's own accounts: every core step is timed, and the gaps it counts are
    only those after a step that left work, never the idle wait before or after a request."""
    await collect(engine, "warm", [5, 6, 7])
    before = engine.stats()
    assert await engine.call(lambda core: core.counters.steps) == before["engine_steps"]
    await collect(engine, "timed", [8, 9, 10])
    s = engine.stats()
    steps = s["engine_steps"] - before["engine_steps"]
    assert steps >= 8  # one step per token at least (8 tokens)
    # the steps between the request's tokens left work: their gaps count; the idle wait before
    # its first step does not (a step that changed nothing also waits, uncounted)
    gaps = s["engine_step_gaps"] - before["engine_step_gaps"]
    assert steps // 2 <= gaps <= steps - 1, (gaps, steps)
    wall = s["engine_step_seconds"] - before["engine_step_seconds"]
    cpu = s["engine_step_cpu_seconds"] - before["engine_step_cpu_seconds"]
    assert wall > 0 and cpu > 0
    # 7 of the 8 tokens come from steps that computed no prompt token
    assert s["engine_decode_steps"] - before["engine_decode_steps"] == 7
    assert 0 < s["engine_decode_step_seconds"] - before["engine_decode_step_seconds"] <= wall
    assert s["engine_step_gap_seconds"] >= before["engine_step_gap_seconds"]


async def test_a_request_counts_in_the_published_load_as_soon_as_it_is_taken(
    engine: AsyncEngine,
) -> None:
    """stats() (what a node's load frames report) counts a request once add_request returns, even
    while the step after it is still running: a node acks a route in its next frame and the
    coordinator then drops its own reservation, so counters as of the last step would count the
    request nowhere for a whole step (0.7-1.4 s for a long prompt's chunk on one CPU thread)."""
    await collect(engine, "warm", [5, 6, 7])
    gate = threading.Event()
    entered = threading.Event()
    real = engine.core.step

    def held_step():  # the step after the add: held until the test has read the load
        entered.set()
        assert gate.wait(30)
        return real()

    engine.core.step = held_step
    try:
        stream = await engine.add_request("taken", list(range(3, 40)), GREEDY)
        assert await asyncio.to_thread(entered.wait, 30)  # the engine is inside that step now
        s = engine.stats()
        assert s["num_requests_waiting"] + s["num_requests_running"] == 1
        assert s["queued_prefill_tokens"] == 37
    finally:
        gate.set()
        engine.core.step = real
    toks = []
    async for out in stream:
        toks += out.new_token_ids
    assert len(toks) == 8
    assert engine.stats()["queued_prefill_tokens"] == 0
