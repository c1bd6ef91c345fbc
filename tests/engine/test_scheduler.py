"""Scheduler + KV manager, exactly, without a model: budgets, chunking, priorities,
preemption, prefix hits, and the P/D hooks."""

from engine.block_pool import BlockPool
from engine.kv_manager import KVCacheManager
from engine.request import Priority, Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig

BS = 4


def make(
    num_blocks: int = 32, budget: int = 16, max_seqs: int = 8, chunked: bool = True
) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, BS))
    return Scheduler(SchedulerConfig(budget, max_seqs, chunked), kv)


def req(
    rid: str, n: int, prio: Priority = Priority.INTERACTIVE, t: float = 0.0, base: int = 0
) -> Request:
    return Request(
        rid, [base + i for i in range(n)], SamplingParams(max_tokens=100), prio, arrival_time=t
    )


def run_step(s: Scheduler) -> dict[str, int]:
    """Schedule one step and pretend the model computed it (sampling token 1 where due)."""
    out = s.schedule()
    for c in out.chunks:
        c.req.num_computed_tokens = c.start + c.num_tokens
        s.kv.cache_computed_blocks(c.req)
    for c in out.chunks:
        if c.samples:
            c.req.output_token_ids.append(1)
    return {c.req.request_id: c.num_tokens for c in out.chunks}


def test_chunked_prefill_respects_budget_and_decodes_first() -> None:
    s = make(budget=16)
    a, b = req("a", 10), req("b", 30, t=1)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 10, "b": 6}
    assert run_step(s) == {"a": 1, "b": 15}
    assert run_step(s) == {"a": 1, "b": 9}
    assert run_step(s) == {"a": 1, "b": 1}


def test_without_chunking_a_prompt_waits_for_a_whole_budget() -> None:
    s = make(budget=16, chunked=False)
    s.add(req("a", 10))
    s.add(req("b", 12, t=1, base=100))
    assert run_step(s) == {"a": 10}
    assert run_step(s) == {"a": 1, "b": 12}


def test_priority_order_interactive_first() -> None:
    s = make(budget=8)
    s.add(req("batch", 8, Priority.BATCH, t=0))
    s.add(req("inter", 8, Priority.INTERACTIVE, t=5))
    assert run_step(s) == {"inter": 8}


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    s = make(num_blocks=6, budget=64)
    a, b = req("a", 8, t=0), req("b", 8, t=1, base=100)
    s.add(a)
    s.add(b)
    assert run_step(s) == {"a": 8, "b": 8}  # 4 of 6 blocks
    for _ in range(4):
        run_step(s)  # each decodes up to 12 tokens: 3 blocks each = 6
    # Next token needs a 4th block for one of them: the later arrival (b) is preempted.
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status is Status.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.num_preemptions == 1


def test_interactive_preempts_running_batch_when_full() -> None:
    s = make(num_blocks=4, budget=64)
    s.add(req("batch", 15, Priority.BATCH))
    run_step(s)  # batch holds all 4 blocks
    s.add(req("inter", 6, Priority.INTERACTIVE, t=9, base=50))
    steps = run_step(s)
    assert "inter" in steps and "batch" not in steps
    assert s.requests["batch"].status is Status.PREEMPTED


def test_prefix_hit_skips_cached_blocks_but_never_the_last_token() -> None:
    s = make(budget=64)
    a = req("a", 12)
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    b = req("b", 12)  # identical prompt: 3 full blocks cached, last token must be computed
    s.add(b)
    assert run_step(s) == {"b": 4}
    assert b.num_cached_tokens == 8
    c = req("c", 14)  # same 12-token prefix + 2 more
    s.add(c)
    assert run_step(s)["c"] == 2
    assert s.kv.prefix_hits == 8 + 12


def test_hold_and_release() -> None:
    s = make()
    a = req("a", 9)
    a.hold_blocks = True
    s.add(a)
    run_step(s)
    s.finish(a, "length")
    free_before = s.kv.pool.num_free
    assert "a" in s.held and len(a.block_ids) == 3
    assert s.release("a") and s.kv.pool.num_free == free_before + 3
    assert not s.release("a")


def test_remote_reserve_then_ready() -> None:
    s = make(budget=64)
    r = req("d", 10)
    r.remote_num_tokens = 10
    s.add(r)
    out = s.schedule()
    assert out.reserved == [r] and out.chunks == []
    assert r.status is Status.WAITING_FOR_REMOTE_KV and len(r.block_ids) == 3
    assert run_step(s) == {}  # waits for the transfer
    s.kv_ready("d", ok=True)
    assert run_step(s) == {"d": 1}  # only the last prompt token is recomputed


def test_remote_failure_recomputes_and_abort_during_transfer_frees_later() -> None:
    s = make(budget=64)
    r = req("d", 10)
    r.remote_num_tokens = 10
    s.add(r)
    s.schedule()
    s.kv_ready("d", ok=False)
    assert run_step(s) == {"d": 10}
    r2 = req("e", 10, base=500)
    r2.remote_num_tokens = 10
    s.add(r2)
    s.schedule()
    used = s.kv.pool.num_used
    s.finish(r2, "abort")
    assert s.kv.pool.num_used == used  # the transfer may still be writing: not freed yet
    s.kv_ready("e", ok=True)
    assert s.kv.pool.num_used == used - 3 and r2.status is Status.FINISHED
