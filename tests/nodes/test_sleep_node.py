"""Sleep mode on a real node behind the cluster secret, registered with a real etcd and
coordinator: the node puts itself to sleep after its idle time and stays registered (the
coordinator sees it asleep); a request wakes it and gets the model's tokens; vLLM's /sleep,
/wake_up and /is_sleeping work and measure the wake; a node with a request in flight refuses
to sleep."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from bench.pd_client import completion
from tests.engine.oracle import hf_greedy
from tests.procs import TINY_NODE_ARGS, Proc, running, secured_plane
from tests.wait import until

SECRET = secrets.token_urlsafe(24)
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    """(coordinator, node): the node sleeps after 1 s without requests."""
    with secured_plane(tmp_path_factory.mktemp("sleep-plane"), SECRET) as plane:
        n = plane.node(
            "both", tiny_llama, *TINY_NODE_ARGS, "--sleep-after-idle-s", "1", node_id="both-0"
        )
        with running(plane.coordinator, n):
            yield plane.coordinator, n


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(headers={"Authorization": f"Bearer {SECRET}"})


async def _state(s: aiohttp.ClientSession, node: Proc) -> dict:
    async with s.get(node.url + "/is_sleeping") as r:
        assert r.status == 200
        return await r.json()


async def test_an_idle_node_sleeps_stays_registered_and_a_request_wakes_it(
    node: tuple[Proc, Proc], tiny_llama: Path
) -> None:
    coord, n = node
    async with _session() as s:

        async def asleep_in_cluster() -> bool:
            async with s.get(coord.url + "/cluster") as r:
                nodes = (await r.json())["nodes"]
            load = nodes[0]["load"] if nodes else None
            return bool(load and load.get("sleeping"))

        await until(asleep_in_cluster, 60, "the coordinator to see the idle node asleep")
        assert (await _state(s, n))["is_sleeping"]
        prompt = list(range(7, 47))
        got = await completion(s, n.url, prompt, GREEDY)
        assert got.error is None and got.token_ids == hf_greedy(tiny_llama, prompt, 8)
        state = await _state(s, n)
        assert state["wakes"] >= 1 and state["last_wake_s"] > 0
    assert "awake: weights rebuilt in" in n.log()


async def test_sleep_and_wake_endpoints(node: tuple[Proc, Proc]) -> None:
    _, n = node
    async with _session() as s:
        async with s.post(n.url + "/sleep?level=1") as r:
            assert r.status == 200 and (await r.json())["is_sleeping"]
        async with s.post(n.url + "/wake_up") as r:
            body = await r.json()
        assert r.status == 200 and not body["is_sleeping"] and body["last_wake_s"] > 0
        async with s.post(n.url + "/sleep?level=3") as r:
            assert r.status == 400


async def test_a_node_with_a_request_in_flight_refuses_to_sleep(node: tuple[Proc, Proc]) -> None:
    _, n = node
    async with _session() as s:
        long = {"prompt": list(range(5, 20)), "max_tokens": 900, "ignore_eos": True, "stream": True}
        async with s.post(n.url + "/v1/completions", json=long) as stream:
            assert stream.status == 200
            await stream.content.readline()  # the first event: the request is in flight
            async with s.post(n.url + "/sleep") as r:
                assert r.status == 409 and "in flight" in (await r.json())["error"]["message"]
            await stream.read()


def test_node_flags_map_onto_the_configs() -> None:
    import argparse

    from duet.cmd_nodes import add_node_arguments, node_config

    def parse(*argv: str) -> argparse.Namespace:
        p = argparse.ArgumentParser()
        add_node_arguments(p, 8100)
        return p.parse_args(list(argv))

    cfg = node_config(
        parse("--max-loras", "4", "--max-lora-rank", "32", "--sleep-after-idle-s", "60"), "both"
    )
    assert (cfg.engine.max_loras, cfg.engine.max_lora_rank, cfg.sleep_after_idle_s) == (4, 32, 60.0)
    assert node_config(parse(), "both").sleep_after_idle_s is None
    with pytest.raises(ValueError, match="only with --engine native"):
        node_config(parse("--max-loras", "2", "--engine", "vllm"), "both")
    with pytest.raises(ValueError, match="positive number of seconds"):
        node_config(parse("--sleep-after-idle-s", "0"), "both")
