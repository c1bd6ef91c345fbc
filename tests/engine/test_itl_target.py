"""SLO-aware chunked prefill (`itl_target_ms`): the online step-time model fits step times, the
scheduler sizes prefill chunks from it so the step stays within the target as the decode batch
grows, a long prompt still completes when decodes alone fill the target, and greedy output is
the same tokens as with the fixed budget (which tests/engine/test_correctness.py holds to
transformers).

The scheduler tests run the real Scheduler and KV manager on a virtual clock: each step's
"measured" time is a known cost function of its shape, fed back through `observe_step` as the
engine does, so every figure is exact and no test depends on this machine's speed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.block_pool import BlockPool
from engine.kv_manager import KVCacheManager
from engine.request import Request
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_model import DEFAULT_PRIOR, Coefficients, OnlineStepModel, StepShape, shape_of

#: the "machine" of the virtual clock: unlike the prior in every coefficient
TRUE = Coefficients(
    intercept_s=0.008, prefill_s=2e-4, decode_s=1.2e-3, context_s=1e-6, attention_s=3e-8
)
TARGET = 0.1


def random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d, p, start = (
            rng.randrange(0, 64),
            rng.choice([0, 0, rng.randrange(1, 512)]),
            rng.randrange(0, 2048),
        )
        if d == 0 and p == 0:
            d = 1
        ctx = sum(rng.randrange(16, 1024) for _ in range(d)) + (start + p if p else 0)
        out.append(StepShape(p, d, ctx, p * (start + p)))
    return out


def trained(noise: float = 0.0, seed: int = 0) -> OnlineStepModel:
    rng = random.Random(seed)
    m = OnlineStepModel()
    for s in random_shapes(256, seed):
        m.observe(s, TRUE.seconds(s) * (1 + rng.uniform(-noise, noise)))
    m.refit()
    return m


def test_the_model_fits_synthetic_step_times() -> None:
    m = trained(noise=0.05)
    held_out = random_shapes(200, seed=7)
    errors = [abs(m.predict(s) - TRUE.seconds(s)) / TRUE.seconds(s) for s in held_out]
    assert sum(errors) / len(errors) < 0.05, f"mean error {sum(errors) / len(errors):.1%}"
    assert max(errors) < 0.25
    # the margin covers the noise's upper tail: measured/predicted at the 90th percentile
    assert 1.0 < m.margin < 1.1
    # exact data is fitted almost exactly (the prior's pseudo-steps weigh little against 256 steps)
    exact = trained(noise=0.0)
    assert all(abs(exact.predict(s) - TRUE.seconds(s)) / TRUE.seconds(s) < 0.03 for s in held_out)


def test_the_prior_holds_directions_the_recent_steps_do_not_cover() -> None:
    m = OnlineStepModel()
    for s in [StepShape(0, d, d * 300) for d in range(1, 33)] * 4:  # decode steps only
        m.observe(s, TRUE.seconds(s))
    m.refit()
    assert m.coef.prefill_s > 0, "no prefill seen: the prior's cost stands, not a free prefill"
    chunk = StepShape(256, 0, 256, 256 * 256)
    assert m.predict(chunk) > 0.5 * DEFAULT_PRIOR.seconds(chunk)
    d16 = StepShape(0, 16, 16 * 300)
    assert abs(m.predict(d16) - TRUE.seconds(d16)) / TRUE.seconds(d16) < 0.05


def test_max_prefill_is_the_largest_chunk_within_the_target() -> None:
    m = trained()
    for decodes, ctx, start in [
        (0, 0, 0),
        (8, 8 * 500, 0),
        (32, 32 * 900, 1024),
        (40, 40 * 600, 2000),
    ]:
        p = m.max_prefill(decodes, ctx, start, TARGET, cap=4096)
        fits, over = (StepShape(n, decodes, ctx + start + n, n * (start + n)) for n in (p, p + 1))
        assert 0 < p < 4096
        assert m.predict(fits) * m.margin <= TARGET < m.predict(over) * m.margin
    assert m.max_prefill(200, 200 * 900, 0, TARGET, cap=4096) == 0, "decodes alone over the target"
    assert m.max_prefill(0, 0, 0, 10.0, cap=300) == 300


def make(budget: int = 512, target: float | None = TARGET, blocks: int = 4096) -> Scheduler:
    return Scheduler(
        SchedulerConfig(budget, 256, True, target), KVCacheManager(BlockPool(blocks, 16))
    )


def step(s: Scheduler) -> tuple[dict[str, int], StepShape, float, float]:
    """One step on the virtual clock: schedule, pretend the forward pass (token 1 where due),
    report the true cost of the step's shape as its measured time. Returns the chunks, the
    shape, its time, and the time the model predicted for it × its margin (when it planned it)."""
    out = s.schedule()
    shape = shape_of(out.chunks)
    planned = s.step_model.predict(shape) * s.step_model.margin if s.step_model else 0.0
    for c in out.chunks:
        c.req.num_computed_tokens = c.start + c.num_tokens
        s.kv.cache_computed_blocks(c.req)
        if c.samples:
            c.req.output_token_ids.append(1)
    seconds = TRUE.seconds(shape)
    s.observe_step(seconds)
    return {c.req.request_id: c.num_tokens for c in out.chunks}, shape, seconds, planned


def add(s: Scheduler, rid: str, n: int, base: int) -> Request:
    r = Request(rid, [base + i for i in range(n)], SamplingParams(max_tokens=10_000))
    s.add(r)
    return r


def decoding(s: Scheduler, batch: int) -> None:
    """`batch` requests past their prompts, decoding (prefilled on the fixed budget, unseen by
    the step model)."""
    model, s.step_model = s.step_model, None
    for i in range(batch):
        add(s, f"d{i}", 200, base=10_000 * (i + 1))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in s.running) or s.waiting:
        step(s)
    s.step_model = model


def test_chunks_shrink_as_the_decode_batch_grows_and_steps_stay_within_the_target() -> None:
    first_chunks = []
    for batch in (1, 16, 48):
        s = make()
        s.step_model = trained()  # warm: fitted on this virtual machine
        decoding(s, batch)
        long = add(s, "long", 3000, base=1)
        chunks = []
        while long.num_computed_tokens < long.num_prompt_tokens:
            got, _, seconds, planned = step(s)
            assert sum(1 for k in got if k.startswith("d")) == batch, "every decode runs every step"
            assert planned <= TARGET
            assert seconds <= TARGET * 1.02, (
                f"batch {batch}: a {got['long']}-token chunk took {seconds:.3f} s"
            )
            chunks.append(got["long"])
        first_chunks.append(chunks[0])
        # later chunks start further in: attention's quadratic part makes them no larger
        assert chunks[-2] <= chunks[0]
    assert first_chunks[0] > first_chunks[1] > first_chunks[2] >= 32, first_chunks


def test_without_a_target_the_fixed_budget_is_unchanged() -> None:
    s = make(budget=512, target=None)
    decoding(s, 16)
    add(s, "long", 3000, base=1)
    got, _, seconds, _ = step(s)
    assert got["long"] == 512 - 16 and s.step_model is None
    assert seconds > TARGET  # the problem the target solves


def test_cold_start_learns_and_a_long_prompt_still_completes_over_the_target() -> None:
    # From the prior, on a machine where 120 decodes alone take longer than the target: prefill
    # gets its minimum chunk every step, and the prompt completes.
    s = make(budget=512)
    decoding(s, 120)
    assert TRUE.seconds(StepShape(0, 120, 120 * 201)) > TARGET
    long = add(s, "long", 1000, base=1)
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        got, *_ = step(s)
        assert got.get("long", 0) >= 32 or long.num_prompt_tokens - long.num_computed_tokens == 0
        steps += 1
    assert steps <= -(-1000 // 32)
    assert long.output_token_ids, "its first token was sampled"
    # from the prior, the model learnt the cost of the steps it ran (those it will plan next)
    d = StepShape(32, 120, 120 * 220 + 1000, 32 * 1000)
    assert abs(s.step_model.predict(d) - TRUE.seconds(d)) / TRUE.seconds(d) < 0.1


def test_a_target_needs_chunked_prefill_and_a_positive_value() -> None:
    with pytest.raises(ValueError, match="positive"):
        SchedulerConfig(512, 8, True, 0.0)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(512, 8, False, 0.1)


def test_greedy_tokens_are_the_same_as_with_the_fixed_budget(tiny_llama: Path) -> None:
    # a target no step can meet: every step takes the minimum chunk, so each prompt spans
    # several steps beside the others' decodes
    rng = random.Random(0)
    ps = [[rng.randrange(3, 380) for _ in range(n)] for n in (5, 40, 70, 150, 33)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    fixed = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=512).generate(ps, params)
    llm = LLM(str(tiny_llama), dtype="float32", max_num_batched_tokens=512, itl_target_ms=0.001)
    slo = llm.generate(ps, params)
    assert llm.engine.scheduler.step_model.num_observed > 0
    assert llm.engine.scheduler.last_prefill_budget == 32
    for p, a, b in zip(ps, fixed, slo, strict=True):
        assert a.token_ids == b.token_ids, f"prompt length {len(p)}"


def test_duet_node_flag_maps_onto_the_engine_config() -> None:
    import argparse

    from duet.cmd_nodes import add_node_arguments, node_config

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_node_arguments(p, 8100)
        return p.parse_args(list(argv))

    assert node_config(parse("--itl-target-ms", "100"), "both").engine.itl_target_ms == 100.0
    assert node_config(parse(), "both").engine.itl_target_ms is None
    for bad in (("--itl-target-ms", "0"), ("--itl-target-ms", "50", "--engine", "vllm")):
        with pytest.raises(ValueError, match="--itl-target-ms takes a positive number"):
            node_config(parse(*bad), "both")
