"""AsyncEngine.embed: jobs queued while the engine thread is busy run together in shared
forwards (cross-request batching), each caller gets its own rows, a bad job fails alone, and
embedding runs beside generation without disturbing it."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core import RequestError
from engine.embed import Pooling


@pytest.fixture
async def engine(tiny_llama: Path):
    e = AsyncEngine(
        EngineConfig(
            model=str(tiny_llama), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=256
        )
    )
    e.start()
    yield e
    await e.stop()


def _rows(blobs: list[bytes]) -> torch.Tensor:
    return torch.from_numpy(np.stack([np.frombuffer(b, dtype=np.float32) for b in blobs]))


async def _while_busy(engine: AsyncEngine, jobs):
    """Hold the engine thread in a command until every job is queued, then let it go."""
    gate = threading.Event()
    blocked = asyncio.ensure_future(engine.call(lambda core: gate.wait(120)))
    await asyncio.sleep(0)  # the blocking command goes first
    tasks = [asyncio.ensure_future(j) for j in jobs]
    while len(engine._embed_jobs) < len(tasks):
        await asyncio.sleep(0.001)  # the jobs queue behind the held thread
    queued = engine.queued_embed_tokens
    gate.set()
    await blocked
    out = await asyncio.gather(*tasks, return_exceptions=True)
    assert engine.queued_embed_tokens == 0
    return queued, out


async def test_queued_jobs_share_forwards_and_each_gets_its_rows(engine: AsyncEngine) -> None:
    prompts = [[5 + i, 9, 30 + i, 7] * (1 + i % 3) for i in range(10)]
    alone = [_rows(await engine.embed([p], Pooling.MEAN))[0] for p in prompts]
    before = engine.core.embedder.forwards
    queued, got = await _while_busy(engine, [engine.embed([p], Pooling.MEAN) for p in prompts])
    assert queued == sum(
        map(len, prompts)
    )  # what the node's load frames report as queued prompt tokens
    assert engine.core.embedder.forwards - before == 1  # ten requests, one forward
    for want, blobs in zip(alone, got, strict=True):
        assert torch.allclose(_rows(blobs)[0], want, atol=1e-5)


async def test_a_bad_job_fails_alone(engine: AsyncEngine) -> None:
    vocab = engine.core.model_config.vocab_size
    jobs = [
        engine.embed([[1, 2, 3]], Pooling.LAST),
        engine.embed([[vocab + 5]], Pooling.LAST),
        engine.embed([[4, 5]], Pooling.LAST, 8),
    ]
    _, (ok, bad, cut) = await _while_busy(engine, jobs)
    assert isinstance(bad, RequestError) and "vocabulary" in str(bad)
    assert _rows(ok).shape == (1, engine.core.model_config.hidden_size) and _rows(cut).shape == (
        1,
        8,
    )


async def test_embedding_beside_generation(engine: AsyncEngine) -> None:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    async def generate() -> list[int]:
        toks: list[int] = []
        async for out in await engine.add_request("g", [3, 4, 5, 6], params):
            toks += out.new_token_ids
        return toks

    solo = await generate()
    together, vec = await asyncio.gather(generate(), engine.embed([[3, 4, 5, 6]] * 4, Pooling.LAST))
    assert together == solo and len(vec) == 4
    pool = await engine.call(lambda core: core.pool)
    assert pool.num_free == pool.num_blocks  # the scratch blocks went back; nothing is held
