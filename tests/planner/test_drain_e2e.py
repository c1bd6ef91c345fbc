"""Drain-safe scale-in on real nodes: a prefill node holding KV that no decode node has pulled
yet is drained (planner/drain.py, the actuators' first step); the decode leg still pulls the
blocks from it and its stream completes; only then is the prefill node idle, and it exits 0.
The same for a prefill node stopped by SIGTERM alone (a pod deleted without its preStop hook):
its grace period waits for the held KV to be pulled.

Real etcd, real prefill and decode processes on the tiny model, the tcp transport moving the
bytes; the hold lease is long (120 s) so that only the pull can end the hold in time."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp

from coordinator.drain import find_node
from coordinator.etcd_server import EtcdServer
from coordinator.etcd_store import EtcdStore
from planner.drain import Drainer
from protocol.cluster import NodeStatus
from tests.coordinator.conftest import metric, node, node_id_of
from tests.procs import running
from tests.wait import until, wait_for


def tokens(n: int) -> list[int]:
    return [(7 + i * 31) % 380 + 1 for i in range(n)]


async def _scenario(p_url: str, d_url: str, etcd_url: str, p_id: str) -> dict[str, object]:
    prompt = tokens(100)
    async with aiohttp.ClientSession() as s:
        leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        async with s.post(p_url + "/v1/completions", json=leg) as r:
            assert r.status == 200, await r.text()
            params = (await r.json())["kv_transfer_params"]
        assert params["do_remote_prefill"] and params["remote_block_ids"]

        # readiness (deploy/'s readinessProbe) and liveness before the drain; a bad probe name
        for probe, want in (("ready", 200), ("live", 200), ("bogus", 400)):
            async with s.get(p_url + "/health", params={"probe": probe}) as r:
                assert r.status == want, (probe, r.status, await r.text())

        drainer = Drainer(s, poll_s=0.1, deadline_s=60)
        drain = asyncio.create_task(drainer.drain(p_url))

        async def held_and_draining() -> dict | None:
            async with s.get(p_url + "/drain") as r:
                st = await r.json()
            return st if st["draining"] and st["held"] == 1 else None

        status = await until(held_and_draining, 10, "P draining with its KV still held")
        assert not status["idle"] and not drain.done()
        # drained: not ready (the scale-in victim ranks as a not-ready pod), but alive (a long
        # drain is not restarted by the liveness probe)
        async with s.get(p_url + "/health", params={"probe": "ready"}) as r:
            assert r.status == 503 and (await r.json())["status"] == "draining"
        async with s.get(p_url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        store = EtcdStore(etcd_url)
        try:
            rec = await until(
                lambda: _draining_in_etcd(store, p_id), 10, "P's registration to say draining"
            )
            assert rec.info.status == NodeStatus.DRAINING
        finally:
            await store.close()

        # the decode leg pulls from the draining P and streams to the end
        body = {"prompt": prompt, "max_tokens": 8, "stream": True, "kv_transfer_params": params}
        events = []
        async with s.post(d_url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
        assert events[-1] == b"[DONE]", events[-3:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any(c.get("error") for c in chunks), chunks
        finish = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        assert finish[-1] in ("length", "stop"), finish
        end = await asyncio.wait_for(drain, 30)
        return {"drained": end.drained, "chunks": len(chunks)}


async def _sigterm_scenario(p, d_url: str) -> None:
    prompt = tokens(90)
    async with aiohttp.ClientSession() as s:
        leg = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        async with s.post(p.url + "/v1/completions", json=leg) as r:
            assert r.status == 200, await r.text()
            params = (await r.json())["kv_transfer_params"]
        p.proc.send_signal(signal.SIGTERM)

        async def held_while_stopping() -> dict | None:
            async with s.get(p.url + "/drain") as r:
                st = await r.json()
            return st if st["draining"] and st["held"] == 1 else None

        await until(held_while_stopping, 10, "P stopping with its KV still held")
        assert p.proc.poll() is None
        body = {"prompt": prompt, "max_tokens": 4, "stream": False, "kv_transfer_params": params}
        async with s.post(d_url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            out = await r.json()
        assert out["choices"][0]["finish_reason"] in ("length", "stop"), out


async def _draining_in_etcd(store: EtcdStore, node_id: str):
    rec = await find_node(store, "default", node_id)
    return rec if rec is not None and rec.info.status == NodeStatus.DRAINING else None


def test_a_prefill_node_holding_unpulled_kv_is_scaled_in_safely(
    tiny_llama: Path, tmp_path: Path, etcd: EtcdServer
) -> None:
    p = node(
        "prefill", tiny_llama, tmp_path, etcd.url, "--exit-when-drained", "--lease-seconds", "120"
    )
    p2 = node("prefill", tiny_llama, tmp_path, etcd.url, "--lease-seconds", "120")
    d = node("decode", tiny_llama, tmp_path, etcd.url)
    with running(p, p2, d):
        out = asyncio.run(_scenario(p.url, d.url, etcd.url, node_id_of(p)))
        assert out["drained"] is True
        # the bytes moved from P (not recomputed on D): D computed only the prompt's tail
        assert metric(d.url, "duet:kv_transfer_bytes_total") > 0
        assert metric(d.url, "duet:prompt_tokens_total") < 100
        # drained and idle: P deregistered and exited 0 on its own
        wait_for(lambda: p.proc.poll() is not None, 30, "the drained prefill node to exit")
        assert p.proc.returncode == 0, p.log()[-2000:]

        # SIGTERM alone: the grace period (30 s) waits for the hold, D pulls it, P exits 0
        moved = metric(d.url, "duet:kv_transfer_bytes_total")
        computed = metric(d.url, "duet:prompt_tokens_total")
        asyncio.run(_sigterm_scenario(p2, d.url))
        assert metric(d.url, "duet:kv_transfer_bytes_total") > moved
        assert metric(d.url, "duet:prompt_tokens_total") - computed < 90
        wait_for(lambda: p2.proc.poll() is not None, 30, "the stopped prefill node to exit")
        assert p2.proc.returncode == 0, p2.log()[-2000:]
