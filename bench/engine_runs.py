"""The measurements of `bench.engine`, each against one in-process EngineCore.

Every figure is measured by driving `EngineCore.step()` directly (no HTTP, no asyncio), so it
is the engine's own throughput: scheduling, the forward pass, sampling and detokenization.
Prompts are random token ids from a seeded generator; prefix caching is off in the engines
these functions get, so no figure is flattered by a cache hit.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, get_args

from bench.flops import ModelShape
from bench.stats import spread
from bench.workload import WorkItem, random_prompt, summarize

if TYPE_CHECKING:
    from engine.config import Quantization


def quantization(scheme: str) -> Quantization | None:
    """A bench's scheme name as EngineConfig takes it: "none" is no quantization, any other
    name must be one of engine.config's Quantization."""
    from engine.config import Quantization

    if scheme == "none":
        return None
    for q in get_args(Quantization):
        if q == scheme:
            return q  # get_args gives the Literal's names (typed Any)
    raise ValueError(f"unknown quantization scheme {scheme!r}")


Progress = Callable[[str], None]


def _greedy(max_tokens: int):
    from engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _drain(eng, on_token: Callable[[str, bool, float], None] | None = None) -> None:
    """Step until the engine has nothing left; `on_token(request_id, finished, t)` per token."""
    while eng.has_unfinished():
        outs, _ = eng.step()
        if on_token is not None:
            now = time.perf_counter()
            for o in outs:
                on_token(o.request_id, o.finished, now)


def _rate_spread(work: float, seconds: list[float]) -> dict[str, float]:
    """work/s at the median time, and its p10/p90 (the p10 rate comes from the p90 time)."""
    t = spread(seconds)
    return {"median": work / t["median"], "p10": work / t["p90"], "p90": work / t["p10"]}


def prefill_once(eng, shape: ModelShape, prompt_len: int, rng: random.Random, rid: str) -> float:
    """Seconds from a fresh random prompt in to its first token out (one prefill)."""
    prompt = random_prompt(rng, prompt_len, shape.vocab)
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, _greedy(1))
    _drain(eng)
    return time.perf_counter() - t0


def prefill(
    eng, shape: ModelShape, prompt_len: int, repeats: int, rng: random.Random
) -> dict[str, Any]:
    """`repeats` single-prompt prefills (after one warm-up), prompt in, first token out; the
    median, as for decode, with p10/p90."""
    prefill_once(eng, shape, prompt_len, rng, "prefill-0")
    times = [
        prefill_once(eng, shape, prompt_len, rng, f"prefill-{r}") for r in range(1, repeats + 1)
    ]
    return prefill_result(shape, prompt_len, times)


def prefill_result(shape: ModelShape, prompt_len: int, times: list[float]) -> dict[str, Any]:
    """prefill()'s figures from the seconds of each timed prefill."""
    repeats = len(times)
    t = spread(times)
    tps = _rate_spread(prompt_len, times)
    return {
        "prompt_tokens": prompt_len,
        "repeats": repeats,
        "seconds": t["median"],
        "seconds_p10": t["p10"],
        "seconds_p90": t["p90"],
        "seconds_best": min(times),
        "tokens_per_s": tps["median"],
        "tokens_per_s_p10": tps["p10"],
        "tokens_per_s_p90": tps["p90"],
        "gflops": shape.prefill_flops(prompt_len) / t["median"] / 1e9,
    }


def steady_decode(
    eng, shape: ModelShape, batch: int, ctx: int, steps: int, rng: random.Random
) -> dict[str, Any]:
    """`batch` sequences with `ctx`-token prompts all decoding; times `steps` pure decode steps
    (prefill excluded: timing starts once every sequence has its first token). tokens/s is
    batch / median step time; the mean over all steps is reported beside it."""
    ids = [f"decode{batch}-{i}" for i in range(batch)]
    for rid in ids:
        eng.add_request(rid, random_prompt(rng, ctx, shape.vocab), _greedy(2 * steps + 64))
    reqs = [eng.request(rid) for rid in ids]
    while any(not r.output_token_ids for r in reqs):
        eng.step()
    eng.step()  # first all-decode step: warm
    ctx_from = reqs[0].num_tokens - 1
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs, _ = eng.step()
        times.append(time.perf_counter() - t0)
        assert len(outs) == batch, "every sequence should decode in every timed step"
    for rid in ids:
        eng.abort(rid)
    # The median step is the steady-state figure: a burst of other work on the machine stalls a
    # few steps by 10x (OpenMP threads wait for a descheduled one) and would dominate a mean.
    t = spread(times)
    tps = _rate_spread(batch, times)
    total = sum(times)
    return {
        "batch": batch,
        "context_tokens": [ctx_from + 1, ctx_from + steps],
        "steps": steps,
        "tokens_per_s": tps["median"],
        "tokens_per_s_p10": tps["p10"],
        "tokens_per_s_p90": tps["p90"],
        "tokens_per_s_mean": batch * steps / total,
        "ms_per_step_median": 1e3 * t["median"],
        "ms_per_step_p10": 1e3 * t["p10"],
        "ms_per_step_p90": 1e3 * t["p90"],
        "ms_per_step_mean": 1e3 * total / steps,
        "ms_per_step_best": 1e3 * min(times),
        "gflops": shape.decode_flops(batch, ctx_from, steps) / (t["median"] * steps) / 1e9,
    }


def end_to_end(
    eng, shape: ModelShape, concurrency: int, input_len: int, output_len: int, rng: random.Random
) -> dict[str, Any]:
    """`concurrency` requests submitted together, run to completion (prefill included)."""
    ids = [f"e2e{concurrency}-{i}" for i in range(concurrency)]
    first: dict[str, float] = {}
    done: dict[str, float] = {}

    def on_token(rid: str, finished: bool, now: float) -> None:
        first.setdefault(rid, now)
        if finished:
            done[rid] = now

    t0 = time.perf_counter()
    for rid in ids:
        eng.add_request(rid, random_prompt(rng, input_len, shape.vocab), _greedy(output_len))
    _drain(eng, on_token)
    wall = max(done.values()) - t0
    tpot = [(done[r] - first[r]) / (output_len - 1) for r in ids] if output_len > 1 else [0.0]
    return {
        "concurrency": concurrency,
        "input_tokens": input_len,
        "output_tokens": output_len,
        "seconds": wall,
        "output_tokens_per_s": concurrency * output_len / wall,
        "ttft_s": summarize([first[r] - t0 for r in ids]),
        "tpot_s": summarize(tpot),
    }


def _online_result(items: list[WorkItem], first: list[float], done: list[float]) -> dict[str, Any]:
    start = items[0].arrival_s
    span = max(done) - start
    out = sum(w.output_len for w in items)
    tpot = [
        (d - f) / (w.output_len - 1)
        for w, f, d in zip(items, first, done, strict=True)
        if w.output_len > 1
    ]
    return {
        "seconds": span,
        "output_tokens_per_s": out / span,
        "requests_per_s": len(items) / span,
        "ttft_s": summarize([f - w.arrival_s for w, f in zip(items, first, strict=True)]),
        "tpot_s": summarize(tpot),
        "e2e_latency_s": summarize([d - w.arrival_s for w, d in zip(items, done, strict=True)]),
    }


def online_engine(eng, items: list[WorkItem], progress: Progress) -> dict[str, Any]:
    """Requests join at their arrival times (continuous batching); latencies count from the
    nominal arrival. Throughput = output tokens / (last finish - first arrival)."""
    pending = deque(enumerate(items))
    first = [0.0] * len(items)
    done = [0.0] * len(items)
    index: dict[str, int] = {}

    def on_token(rid: str, finished: bool, now: float) -> None:
        i = index[rid]
        if not first[i]:
            first[i] = now - t0
        if finished:
            done[i] = now - t0

    t0 = time.perf_counter()
    while pending or eng.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][1].arrival_s <= now:
            i, w = pending.popleft()
            index[f"online-{i}"] = i
            eng.add_request(f"online-{i}", w.prompt, _greedy(w.output_len))
        if eng.has_work():
            outs, _ = eng.step()
            t = time.perf_counter()
            for o in outs:
                on_token(o.request_id, o.finished, t)
        elif pending:
            time.sleep(max(0.0, pending[0][1].arrival_s - (time.perf_counter() - t0)))
    progress(f"engine served {len(items)} requests in {max(done) - items[0].arrival_s:.1f}s")
    return _online_result(items, first, done)


def _static_groups(items: list[WorkItem], batch: int, t0: float):
    """Static batching's admission: whenever the previous batch is done, up to `batch` of the
    requests that have arrived (waiting for the next arrival when none has)."""
    pending = deque(enumerate(items))
    while pending:
        now = time.perf_counter() - t0
        if pending[0][1].arrival_s > now:
            time.sleep(pending[0][1].arrival_s - now)
            continue
        group: list[tuple[int, WorkItem]] = []
        while pending and pending[0][1].arrival_s <= now and len(group) < batch:
            group.append(pending.popleft())
        yield group


def online_engine_static(
    eng, items: list[WorkItem], batch: int, progress: Progress
) -> dict[str, Any]:
    """The ablation: the same engine, but admitted like transformers' static batches (a batch
    runs to its last request's end before the next is formed). Each request still stops at
    its own length and streams its own tokens; only continuous admission is taken away, so
    engine / engine_static is continuous batching's share and engine_static / transformers the
    rest (kernels, prepacked GEMMs, paged KV)."""
    first = [0.0] * len(items)
    done = [0.0] * len(items)
    index: dict[str, int] = {}

    def on_token(rid: str, finished: bool, now: float) -> None:
        i = index[rid]
        if not first[i]:
            first[i] = now - t0
        if finished:
            done[i] = now - t0

    t0 = time.perf_counter()
    for group in _static_groups(items, batch, t0):
        for i, w in group:
            index[f"static-{i}"] = i
            eng.add_request(f"static-{i}", w.prompt, _greedy(w.output_len))
        _drain(eng, on_token)
    progress(
        f"engine with static batches served {len(items)} requests in "
        f"{max(done) - items[0].arrival_s:.1f}s"
    )
    return _online_result(items, first, done)


def online_transformers(
    model, items: list[WorkItem], batch: int, pad_id: int, progress: Progress
) -> dict[str, Any]:
    """transformers `generate` with static batching: whenever idle, take up to `batch` arrived
    requests, left-pad them into one batch and generate until every row has its own requested
    length. A row stops at its own length (a per-row stopping criterion: it gets no extra
    tokens, and its first/last token times are those of the steps that produced them); the
    batch ends with its longest row, as static batching does. EOS is disabled (the engine runs
    with ignore_eos), so lengths are exactly the workload's. Same workload, same accounting."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    first = [0.0] * len(items)
    done = [0.0] * len(items)

    class PerRowLength(StoppingCriteria):
        def __init__(self, group: list[tuple[int, WorkItem]], width: int) -> None:
            self.group, self.width = group, width
            self.lengths = torch.tensor([w.output_len for _, w in group])

        def __call__(
            self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
        ) -> torch.Tensor:
            now = time.perf_counter() - t0
            generated = input_ids.shape[1] - self.width
            stop = generated >= self.lengths
            for i, w in self.group:
                if generated == 1:
                    first[i] = now
                if generated == w.output_len:
                    done[i] = now
            return stop

    t0 = time.perf_counter()
    for group in _static_groups(items, batch, t0):
        width = max(len(w.prompt) for _, w in group)
        new = max(w.output_len for _, w in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for r, (_, w) in enumerate(group):
            ids[r, width - len(w.prompt) :] = torch.tensor(w.prompt)
            mask[r, width - len(w.prompt) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=pad_id,
                stopping_criteria=StoppingCriteriaList([PerRowLength(group, width)]),
            )
        if out.shape[1] - width != new or any(not done[i] for i, _ in group):
            raise RuntimeError(
                f"transformers generated {out.shape[1] - width} steps for a batch whose longest "
                f"request asks for {new}: the baseline would not be the same work"
            )
        end = time.perf_counter() - t0
        progress(
            f"transformers: batch of {len(group)} (prompt width {width}, {new} steps) done at "
            f"{end:.1f}s"
        )
    return _online_result(items, first, done)
