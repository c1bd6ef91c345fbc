"""The gateway's batch runner yields to interactive load: `may_run` is False while an
interactive request waits for an admission slot, or while every slot is taken."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.batch.wiring import batch_may_run
from gateway.config import parse_config
from gateway.metrics import GatewayMetrics
from gateway.serving.tiers import Admission


async def test_may_run_follows_the_interactive_queue(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "models": {"m": {"tokenizer": "x", "static": {"both": ["http://127.0.0.1:9"]}}},
            "store": {"url": f"sqlite://{tmp_path}/gateway.db"},
            "tiers": {"max_inflight": 1},
        }
    )
    admission = Admission(cfg.tiers, GatewayMetrics())  # the gateway's, as its state holds it
    may_run = batch_may_run(admission, cfg.tiers)  # what the runner is given
    assert may_run()
    async with admission.slot("interactive"):
        assert not may_run()  # every slot is taken: a batch line would only queue
        second = admission.slot("interactive")
        waiter = asyncio.ensure_future(second.__aenter__())
        while admission.depth("interactive") == 0:
            await asyncio.sleep(0)
        assert not may_run()
    await waiter  # the freed slot went to the interactive waiter
    assert not may_run()
    await second.__aexit__(None, None, None)  # the waiter's request ends
    assert admission.depth("interactive") == 0 and admission.running == 0
    assert may_run()
