"""The load loop of `duet bench serve`: sends each request at its planned time (a gamma
arrival process, or a trace's timestamps), at most --max-concurrency at once, until
--num-requests have been sent or --duration has passed, then waits for those in flight.

Invariants: the run ends by itself (a bounded count or duration, and every request bounded by
--request-timeout); a failed request is recorded and the run goes on; warm-up requests are
sent and finished before the measured clock starts and are never recorded; every send goes to
`cfg.url` only.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
import uuid
from collections.abc import Callable, Iterator

import aiohttp
import msgspec

from bench import payload, sse_client
from bench.arrivals import send_offsets
from bench.mix import Mixer
from bench.records import RequestRecord
from bench.serve_config import ServeConfig
from bench.workloads import BenchRequest


class RunOutcome(msgspec.Struct, kw_only=True):
    records: list[RequestRecord]
    #: seconds from the first planned send to the last completion
    duration_s: float
    started_at: float  # wall clock (epoch seconds) of the start
    warmup_sent: int = 0
    warmup_failed: int = 0
    #: stopped early by Ctrl-C
    interrupted: bool = False


OnDone = Callable[[RequestRecord], None]


async def warm_up(
    session: aiohttp.ClientSession, cfg: ServeConfig, requests: Iterator[BenchRequest]
) -> tuple[int, int]:
    """Send cfg.warmup requests (at most --max-concurrency at once); returns (sent, failed)."""
    if cfg.warmup <= 0:
        return 0, 0
    mixer = Mixer(cfg, cfg.seed + 2)
    sem = asyncio.Semaphore(cfg.max_concurrency or cfg.warmup)
    run_id = uuid.uuid4().hex[:8]

    async def one(i: int, req: BenchRequest) -> RequestRecord:
        _, key, tier = mixer.draw()
        rec = RequestRecord(
            index=i, prompt_len=req.prompt_len, max_tokens=req.output_len, scheduled_s=0.0
        )
        async with sem:
            return await sse_client.send(
                session,
                cfg.url,
                payload.body(cfg, req, tier),
                payload.headers(cfg, key, tier, f"bench-warmup-{run_id}-{i}"),
                rec,
                cfg.request_timeout,
                time.perf_counter(),
            )

    recs = await asyncio.gather(
        *(one(i, r) for i, r in enumerate(itertools.islice(requests, cfg.warmup)))
    )
    return len(recs), sum(not r.ok for r in recs)


async def run_load(
    session: aiohttp.ClientSession,
    cfg: ServeConfig,
    requests: Iterator[BenchRequest],
    on_done: OnDone | None = None,
    stop: asyncio.Event | None = None,
) -> RunOutcome:
    """Send the run; `stop` (Ctrl-C) ends the sending early, like the end of --duration."""
    stop = stop or asyncio.Event()
    mixer = Mixer(cfg, cfg.seed + 1)
    offsets = send_offsets(cfg.request_rate, cfg.burstiness, random.Random(cfg.seed + 3))
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    run_id = uuid.uuid4().hex[:8]
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task[RequestRecord | None]] = []
    started_at = time.time()
    start = time.perf_counter()

    def over() -> bool:
        return stop.is_set() or (
            cfg.duration_s is not None and time.perf_counter() - start >= cfg.duration_s
        )

    async def one(rec: RequestRecord, req: BenchRequest, key: str | None) -> RequestRecord | None:
        try:
            # The task starts a moment after the loop decided to send: a send that would start
            # past --duration (or after Ctrl-C) is not made, so no request starts after the end.
            if over():
                return None
            records.append(rec)
            await sse_client.send(
                session,
                cfg.url,
                payload.body(cfg, req, rec.tier),
                payload.headers(cfg, key, rec.tier, f"bench-{run_id}-{rec.index}"),
                rec,
                cfg.request_timeout,
                start,
            )
        finally:
            if sem is not None:
                sem.release()
        if on_done is not None:
            on_done(rec)
        return rec

    count = itertools.count() if cfg.num_requests is None else range(cfg.num_requests)
    for i, req in zip(count, requests, strict=False):
        planned = req.arrival_s if req.arrival_s is not None else next(offsets)
        if cfg.duration_s is not None and planned >= cfg.duration_s:
            break
        delay = start + planned - time.perf_counter()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await stop.wait()
        if over():
            break
        if sem is not None:
            await sem.acquire()  # a slot frees within --request-timeout
            if over():
                sem.release()
                break
        team, key, tier = mixer.draw()
        rec = RequestRecord(
            index=i,
            prompt_len=req.prompt_len,
            max_tokens=req.output_len,
            scheduled_s=planned,
            team=team,
            tier=tier,
            group=req.group,
            prefix_tokens=req.prefix_tokens,
        )
        tasks.append(asyncio.create_task(one(rec, req, key)))
        await asyncio.sleep(0)  # let the new task start its send before the next one is planned
    await asyncio.gather(*tasks)
    return RunOutcome(
        records=records,
        duration_s=time.perf_counter() - start,
        started_at=started_at,
        interrupted=stop.is_set(),
    )
