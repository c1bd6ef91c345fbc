"""A node whose engine dies is never half alive: an SSE stream in
flight ends with an error event (never a second response), a JSON request in flight and every
new one get 503, /health says 503, and the node's shutdown is triggered with exit code 1 so a
supervisor restarts it. In-process (the real app, engine and HTTP server): the fault — an error
in the scheduler's own state — is injected into the engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

import decode
import prefill
from engine import EngineConfig
from node.app import make_app
from node.config import NodeConfig
from node.server import build_state
from tests.procs import free_port
from tests.wait import until


async def test_engine_death_answers_503_and_stops_the_node(tiny_llama: Path) -> None:
    cfg = NodeConfig(
        role="both",
        port=free_port(),
        transport="tcp",
        engine=EngineConfig(model=str(tiny_llama), dtype="float32", num_kv_blocks=64),
    )
    state = build_state(cfg, [prefill.register, decode.register])
    async with TestClient(TestServer(make_app(state))) as client:
        body = {"prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "temperature": 0}
        sse = await client.post("/v1/completions", json={**body, "stream": True})
        assert sse.status == 200
        first = await sse.content.readline()
        assert first.startswith(b"data: ")
        plain = asyncio.ensure_future(client.post("/v1/completions", json=body))
        await until(lambda: state.inflight == 2, 30, "the JSON request in flight beside the stream")

        def broken():
            raise RuntimeError("scheduler state corrupted")

        state.engine.async_engine.core.scheduler.schedule = broken  # type: ignore[attr-defined]
        rest = (await sse.content.read()).decode()
        events = [ln[6:] for ln in rest.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["code"] == "engine_dead" and "corrupted" in err["message"]
        r = await plain
        assert r.status == 503 and (await r.json())["error"]["code"] == "engine_dead"
        r = await client.post("/v1/completions", json=body)
        assert r.status == 503 and (await r.json())["error"]["code"] == "engine_dead"
        r = await client.get("/health")
        assert r.status == 503 and (await r.json())["status"] == "failed"
        await asyncio.wait_for(state.shutdown.wait(), 10)
        assert state.exit_code == 1
