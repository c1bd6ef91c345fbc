"""A batch line runs under one request id however often it runs (its usage record's key, so a
rerun after a crash is billed once). A rerun can reach a node that still holds the dead run's
request of that id — the node learns of its gateway's death only when it notices the dropped
connection — and a node refuses a second request under an id in use: the fresh-clone CI saw a
line of `test_gateway_sigkill_mid_batch_then_restart` fail so (39 of 40 completed). Each run's
legs now carry their own id (the line's id and a suffix), while the usage record, the answer's
id and the output line keep the line's.

Real parts: a tiny-model node process; the gateway's app in process, its batch executor
(gateway/batch/wiring.py::GatewayExecutor) called as the runner calls it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from gateway.accounts.store.base import Team
from gateway.app import STATE, make_app
from gateway.batch.wiring import GatewayExecutor
from gateway.config import parse_config
from tests.gateway.helpers import metric
from tests.procs import TINY_NODE_ARGS, duet_node, running
from tests.wait import until


async def _positive(read: Callable[[], Awaitable[float]]) -> bool:
    return await read() > 0


async def test_a_rerun_under_the_same_id_while_the_first_run_is_on_the_node(
    tiny_llama: Path, tmp_path: Path
) -> None:
    node = duet_node("both", str(tiny_llama), tmp_path, *TINY_NODE_ARGS)
    with running(node):
        cfg = parse_config(
            {
                "store": {"url": f"sqlite://{tmp_path / 'g.db'}"},
                "models": {"tiny": {"tokenizer": str(tiny_llama), "static": {"both": [node.url]}}},
            }
        )
        app = make_app(cfg)
        async with TestClient(TestServer(app)):
            state = app[STATE]
            await state.store.create_team(Team(id="t"))
            run = GatewayExecutor(state.serving, state.store, discount=0.5)
            long = {"model": "tiny", "prompt": "a long one", "max_tokens": 600, "ignore_eos": True}
            first = asyncio.ensure_future(
                run("t", "/v1/completions", long, request_id="req-line-7")
            )
            # metrics read off the loop: the node's answer must not wait on this loop
            running_on_node = lambda: asyncio.to_thread(  # noqa: E731
                metric, node.url, "duet:num_requests_running"
            )
            await until(
                lambda: _positive(running_on_node), 60, "the first run decoding on the node"
            )
            # the first run is still decoding on the node when the rerun arrives under its id
            status, body = await run(
                "t", "/v1/completions", {**long, "max_tokens": 4}, request_id="req-line-7"
            )
            assert status == 200, body
            assert body["id"] == "cmpl-line-7"  # the answer keeps the line's id
            assert not first.done()  # it really overlapped
            status1, _ = await asyncio.wait_for(first, 120)
            assert status1 == 200
            records = await state.store.usage_records("t", 0, 2e9)
            assert [r.request_id for r in records] == [
                "req-line-7"
            ]  # billed once, under the line's id
