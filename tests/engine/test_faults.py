"""Engine faults stay with the request that caused them: tiny temperatures, sampling
and forward-pass errors, holds that expire on the engine thread, aborts of held requests, an
idle engine that does not spin, the bounded waiting queue, and quarantined KV blocks."""

from __future__ import annotations

import asyncio
import math
import os
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError
from engine.block_pool import BlockPool
from engine.core import EngineOverloaded
from engine.kv_manager import KVCacheManager
from engine.outputs import Fault
from engine.request import Request, Status
from engine.sampler import Sampler
from engine.scheduler import Scheduler, SchedulerConfig
from tests.wait import until

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def make_engine(tiny_llama: Path, **kw) -> AsyncEngine:
    return AsyncEngine(
        EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=128, **kw)
    )


@pytest.fixture
async def engine(tiny_llama: Path):
    e = make_engine(tiny_llama)
    e.start()
    yield e
    await e.stop()


async def collect(e: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY):
    stream = await e.add_request(rid, prompt, params)
    return [o async for o in stream]


async def num_free(e: AsyncEngine) -> int:
    return await e.call(lambda core: core.pool.num_free)


# -- defect 1: one request must not kill the engine -------------------------------------------


def test_tiny_temperature_is_greedy() -> None:
    for t in (1e-45, 1e-30, 1e-6):
        assert SamplingParams(temperature=t).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    for bad in (math.nan, math.inf, -1e-45):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**70)


async def test_tiny_temperature_request_completes_and_engine_lives(
    engine: AsyncEngine, tiny_llama: Path
) -> None:
    prompt = [5, 6, 7, 8]
    outs = await collect(
        engine, "tiny-t", prompt, SamplingParams(max_tokens=8, temperature=1e-45, ignore_eos=True)
    )
    want = LLM(str(tiny_llama), dtype="float32").generate([prompt], GREEDY)[0].token_ids
    assert [t for o in outs for t in o.new_token_ids] == want
    assert outs[-1].finish_reason == "length" and engine.dead is None


def test_sampler_fails_only_the_bad_row() -> None:
    logits = torch.randn(3, 50)
    logits[1] = math.nan  # a row whose probabilities are not finite
    p = SamplingParams(temperature=0.7, seed=1)
    tokens, errors = Sampler().sample_rows(
        logits, [("a", p, True), ("b", p, True), ("c", GREEDY, True)]
    )
    assert set(errors) == {1} and "not finite" in errors[1]
    assert 0 <= tokens[0] < 50 and tokens[2] == int(logits[2].argmax())


def test_a_greedy_row_with_nan_logits_fails_alone() -> None:
    """argmax over NaN picked a token as if it meant something; now the row is the request's
    error and the other rows keep theirs."""
    logits = torch.randn(3, 50)
    logits[0] = math.nan
    logits[2, 7] = math.inf
    tokens, errors = Sampler().sample_rows(
        logits, [("a", GREEDY, True), ("b", GREEDY, True), ("c", GREEDY, True)]
    )
    assert set(errors) == {0, 2} and all("not finite" in e for e in errors.values())
    assert tokens[0] == tokens[2] == -1 and tokens[1] == int(logits[1].argmax())


async def test_a_sampling_failure_is_the_requests_fault(engine: AsyncEngine) -> None:
    """A row the sampler cannot draw from is the request's own failure (every replica computes
    the same), so the node answers it as the client's error; a forward pass that raises stays
    the engine's (test_forward_error_fails_that_step_only)."""
    core = engine.core
    real = core.runner.execute

    def nan_logits(chunks):
        samplers, logits, prompt_rows = real(chunks)
        core.runner.execute = real
        return samplers, torch.full_like(logits, math.nan), prompt_rows

    core.runner.execute = nan_logits
    outs = await collect(engine, "nan-victim", [5, 6, 7, 8])
    assert outs[-1].finish_reason == "error" and "not finite" in outs[-1].error
    assert outs[-1].fault is Fault.REQUEST
    assert engine.dead is None and await num_free(engine) == 128


async def test_forward_error_fails_that_step_only(engine: AsyncEngine) -> None:
    core = engine.core
    real = core.runner.execute
    calls = {"n": 0}

    def flaky(chunks):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward failure")
        return real(chunks)

    core.runner.execute = flaky
    outs = await collect(engine, "victim", [5] * 40)
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert "injected forward failure" in outs[-1].error and outs[-1].fault is Fault.ENGINE
    assert engine.dead is None and await num_free(engine) == 128  # its blocks were freed
    assert len([t for o in await collect(engine, "next", [5, 6, 7]) for t in o.new_token_ids]) == 8
    assert engine.stats()["num_requests_failed"] == 1


async def test_engine_death_is_reported_not_hidden(tiny_llama: Path) -> None:
    e = make_engine(tiny_llama)
    dead: list[BaseException] = []
    e.start(on_dead=dead.append)
    try:
        stream = await e.add_request("s", [5, 6], SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break

        def broken():
            raise RuntimeError("scheduler state corrupted")

        e.core.scheduler.schedule = broken  # an error outside any request's work
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        await until(lambda: asyncio.sleep(0, bool(dead)), what="on_dead")
        assert isinstance(dead[0], RuntimeError) and e.dead is not None
        with pytest.raises(EngineDeadError):
            await e.add_request("t", [5], GREEDY)
    finally:
        await e.stop()


# -- defect 2: holds are atomic with their lease ----------------------------------------------


async def test_hold_expires_on_the_engine_thread(engine: AsyncEngine) -> None:
    outs = await collect_held(engine, "p", 0.3)
    assert len(outs[-1].held_block_ids) == 3 and await num_free(engine) == 125
    # Nothing but the engine itself frees them: no lease manager, no command.
    await until(lambda: engine.call(lambda core: core.pool.num_free == 128), what="hold expiry")
    assert await engine.call(lambda core: core.held_blocks("p")) is None


async def test_abort_frees_held_blocks(engine: AsyncEngine) -> None:
    await collect_held(engine, "p", None)  # held until released
    assert await num_free(engine) == 125
    assert await engine.abort("p")
    assert await num_free(engine) == 128
    assert not await engine.abort("p")
    assert await engine.release_held("p") is None


async def collect_held(e: AsyncEngine, rid: str, seconds: float | None):
    stream = await e.add_request(
        rid,
        list(range(3, 40)),
        SamplingParams(max_tokens=1),
        hold_blocks=True,
        hold_seconds=seconds,
    )
    return [o async for o in stream]


# -- defect 3: a stuck queue does not spin the engine thread ----------------------------------


def thread_cpu_seconds(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_stuck_queue_does_not_spin(engine: AsyncEngine) -> None:
    # Two held prefills pin 126 of the 128 blocks: a 20-block request waits, unadmissible.
    for i in range(2):
        s = await engine.add_request(
            f"big{i}", [10 + i] * 1000, SamplingParams(max_tokens=1), hold_blocks=True
        )
        [o async for o in s]
    stuck = await engine.add_request("stuck", [5] * 320, GREEDY)
    await until(
        lambda: asyncio.sleep(0, engine.stats()["num_requests_waiting"] == 1), what="waiting"
    )
    tid = engine.thread_id
    assert tid is not None
    cpu0, wall0 = thread_cpu_seconds(tid), time.monotonic()
    await asyncio.sleep(1.5)
    cpu, wall = thread_cpu_seconds(tid) - cpu0, time.monotonic() - wall0
    assert cpu < 0.1 * wall, f"the idle engine thread used {cpu:.2f} s of CPU in {wall:.2f} s"
    # And it wakes when something changes: freeing the held blocks admits the request.
    assert await engine.release("big0")
    outs = [o async for o in stuck]
    assert outs[-1].finish_reason == "length"


# -- defect 6: the waiting queue is bounded ---------------------------------------------------


async def test_full_queue_refuses_with_overload(tiny_llama: Path) -> None:
    e = make_engine(tiny_llama, max_waiting_requests=2, max_waiting_tokens=100_000)
    e.start()
    try:
        for i in range(2):  # pin the pool so the queue cannot drain
            s = await e.add_request(
                f"big{i}", [10 + i] * 1000, SamplingParams(max_tokens=1), hold_blocks=True
            )
            [o async for o in s]
        waiting = [await e.add_request(f"w{i}", [5] * 320, GREEDY) for i in range(2)]
        with pytest.raises(EngineOverloaded, match="queue is full"):
            await e.add_request("w2", [5] * 20, GREEDY)
        await e.call(
            lambda core: None
        )  # a command: the stats snapshot is fresh after the next step
        st = await e.call(lambda core: core.stats())
        assert st["queue_full"] == 1 and st["num_requests_rejected_queue_full"] == 1
        assert await e.abort("w0") and await e.abort("w1")
        for w in waiting:
            assert [o async for o in w][-1].finish_reason == "abort"
        # Room again: requests are accepted.
        assert await e.release("big0") and await e.release("big1")
        assert [o async for o in await e.add_request("w3", [5] * 20, GREEDY)][
            -1
        ].finish_reason == "length"
    finally:
        await e.stop()


async def test_queue_bounded_by_tokens(tiny_llama: Path) -> None:
    e = make_engine(tiny_llama, max_waiting_requests=100, max_waiting_tokens=400)
    e.start()
    try:
        for i in range(2):
            s = await e.add_request(
                f"big{i}", [10 + i] * 1000, SamplingParams(max_tokens=1), hold_blocks=True
            )
            [o async for o in s]
        await e.add_request("w0", [5] * 320, GREEDY)
        with pytest.raises(EngineOverloaded, match="tokens"):
            await e.add_request("w1", [5] * 100, GREEDY)
        await e.add_request("w2", [5] * 80, GREEDY)  # still fits
    finally:
        await e.stop()


# -- defect 5: blocks a failed transfer may still write are never reused ----------------------


def remote_req(rid: str, n: int, base: int = 3) -> Request:
    r = Request(request_id=rid, prompt_token_ids=[base + i for i in range(n)], params=GREEDY)
    r.remote_num_tokens = n
    return r


def test_quarantined_blocks_are_not_reused_until_released() -> None:
    pool = BlockPool(16, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(pool))
    r = remote_req("d", 10)
    s.add(r)
    assert s.schedule().reserved == [r]
    target = list(r.block_ids)  # the blocks the transfer writes into
    assert len(target) == 3
    s.kv_ready("d", ok=False, quarantine=True)  # timed out, may still be writing
    assert r.block_ids == [] and r.status is Status.RUNNING
    assert s.kv.quarantined("d") == target and s.kv.num_quarantined == 3
    # The request recomputes into fresh blocks; nothing else ever gets the quarantined ones.
    out = s.schedule()
    assert [c.num_tokens for c in out.chunks] == [10] and not set(r.block_ids) & set(target)
    others = pool.allocate(pool.num_free)
    assert not set(others) & set(target)
    pool.free(others)
    s.finish(r, "length")
    assert pool.num_free == 16 - 3
    assert s.kv.release_quarantine("d") == 3  # the transport says the transfer is over
    assert pool.num_free == 16 and s.kv.num_quarantined == 0


def test_quarantine_of_an_aborted_transfer() -> None:
    pool = BlockPool(16, 4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64), KVCacheManager(pool))
    r = remote_req("d", 10)
    s.add(r)
    s.schedule()
    s.finish(r, "abort")  # the client left while the transfer ran
    s.kv_ready("d", ok=False, quarantine=True)
    assert r.status is Status.FINISHED and pool.num_free == 13
    s.kv.release_quarantine("d")
    assert pool.num_free == 16


def test_a_row_that_breaks_the_batch_fails_alone() -> None:
    logits = torch.randn(2, 50)
    good = SamplingParams(temperature=0.7, top_k=5, seed=3)
    bad = SamplingParams(temperature=0.7, seed=3)
    bad.top_p = None  # past validation (as a buggy caller could): the batched math fails
    tokens, errors = Sampler().sample_rows(logits, [("a", good, True), ("b", bad, True)])
    assert set(errors) == {1} and "TypeError" in errors[1]
    assert tokens[0] in logits[0].topk(5).indices.tolist()


# -- a release answers without waiting for the engine thread's current step --------------------


async def test_release_answers_while_a_step_runs(engine: AsyncEngine) -> None:
    """D's pull is confirmed by P's release; it must not wait for P's forward pass (on a busy
    prefill node that is the length of a prefill chunk, and it lands in D's time to first token)."""
    import threading

    await collect_held(engine, "p", 30.0)
    busy, go = threading.Event(), threading.Event()

    def long_step(core) -> None:  # stands in for a long forward pass on the engine thread
        busy.set()
        go.wait(30)

    blocked = asyncio.ensure_future(engine.call(long_step))
    await asyncio.to_thread(busy.wait, 10)
    try:
        # Fails on an engine that routes the release through its thread: it would wait for `go`.
        n = await asyncio.wait_for(engine.release_held("p", None), 10)
    finally:
        go.set()
        await blocked
    assert n == 3
    await until(lambda: engine.call(lambda core: core.pool.num_free == 128), what="blocks freed")
    assert await engine.release_held("p") is None  # released once


def test_claimed_hold_is_not_expired_and_expired_hold_is_not_claimed() -> None:
    from engine.holds import Claim, HoldLedger

    ledger = HoldLedger()
    ledger.add("a", [1, 2], expiry=10.0)
    ledger.add("b", [3], expiry=10.0)
    assert ledger.claim("a", [2, 1], now=5.0) == (Claim.NOT_THEIRS, 0)
    assert ledger.claim("a", [1, 2], now=5.0) == (Claim.OK, 2)
    assert not ledger.expire("a")  # claimed first: expiry must leave it to the release
    assert ledger.claim("b", None, now=10.0) == (Claim.NOT_HELD, 0)  # deadline passed: stale
    assert ledger.expire("b")
    assert ledger.claim("b", None, now=1.0) == (Claim.NOT_HELD, 0)


def test_scheduler_expiry_skips_a_claimed_hold() -> None:
    pool = BlockPool(16, 4)
    sched = Scheduler(SchedulerConfig(), KVCacheManager(pool))
    req = Request(
        "p", list(range(3, 12)), SamplingParams(max_tokens=1), hold_blocks=True, hold_seconds=1.0
    )
    sched.add(req)
    out = sched.schedule()
    assert out.chunks
    sched.finish(req, "length")
    assert "p" in sched.held and pool.num_free == 13
    assert sched.ledger.claim("p", None, now=time.monotonic())[0].value == "ok"
    assert sched.expire_holds(time.monotonic() + 5) == []  # the claimer's release frees it
    assert pool.num_free == 13 and sched.next_hold_expiry() is None
    assert sched.release("p") and pool.num_free == 16


async def test_command_queued_when_the_engine_dies_fails_instead_of_hanging(
    tiny_llama: Path,
) -> None:
    """A command submitted while the fatal step runs is never executed; its caller must get
    EngineDeadError, not wait forever (a request arriving at that moment hung the node's handler).
    """
    import threading

    e = make_engine(tiny_llama)
    e.start()
    in_step, go = threading.Event(), threading.Event()

    def dying_schedule():
        in_step.set()
        go.wait(30)
        raise RuntimeError("scheduler state corrupted")

    try:
        stream = await e.add_request(
            "a", [5, 6, 7], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        )
        e.core.scheduler.schedule = dying_schedule  # type: ignore[method-assign]
        await asyncio.to_thread(in_step.wait, 10)
        queued = asyncio.ensure_future(e.call(lambda core: core.pool.num_free))
        await asyncio.sleep(0)  # let the command reach the queue before the step fails
        go.set()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(queued, 10)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
    finally:
        go.set()
        await e.stop()
