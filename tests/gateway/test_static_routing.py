"""The gateway's own routing (no coordinator answers) pairs P and D by the coordinator's rule:
D first, then only a P with D's KV layout hash, else prefill on D — from NodeInfo records as
the etcd view reads them. A configured static list (no hashes) pairs as it always did.
Pure: no processes."""

from __future__ import annotations

import pytest

from gateway.backends.etcd_view import pools_from
from gateway.backends.routing import NodeLoad, StaticRouter
from gateway.config import StaticNodes
from protocol.cluster import NodeInfo, kv_layouts_match
from protocol.openai import APIError
from protocol.route import RouteRequest, RouteResponse

MODEL = "tiny"


def info(
    node_id: str, role: str, layout: str, *, model: str = MODEL, status: str = "active"
) -> NodeInfo:
    return NodeInfo(
        node_id=node_id,
        role=role,
        url=f"http://{node_id}:8000",
        model=model,
        engine_id=node_id,  # type: ignore[arg-type]
        block_size=16,
        kv_layout_hash=layout,
        kv_capacity_blocks=256,
        max_model_len=1024,
        status=status,
        started_at=0.0,
    )  # type: ignore[arg-type]


def url(node_id: str) -> str:
    return f"http://{node_id}:8000"


async def route(
    pools: dict[str, StaticNodes], load: NodeLoad | None = None, exclude: tuple[str, ...] = ()
) -> RouteResponse:
    router = StaticRouter(pools.get, load or NodeLoad())
    return await router.route(
        RouteRequest(
            model=MODEL, block_hashes=[], num_prompt_tokens=40, max_tokens=8, exclude=list(exclude)
        )
    )


def busy(*urls: str, n: int = 3) -> NodeLoad:
    """A gateway with `n` requests in flight on each of `urls`."""
    load = NodeLoad()
    for u in urls:
        for _ in range(n):
            load.acquire(u)
    return load


async def test_only_a_prefill_node_with_the_decode_nodes_layout() -> None:
    # p-other is the least loaded P, but its KV layout is not D's: p-same must be chosen.
    pools = pools_from(
        [info("d", "decode", "A"), info("p-other", "prefill", "B"), info("p-same", "prefill", "A")]
    )
    r = await route(pools, busy(url("p-same")))
    assert r.decode.url == url("d")
    assert r.prefill is not None and r.prefill.url == url("p-same"), r


async def test_no_prefill_node_with_the_layout_prefills_on_decode() -> None:
    pools = pools_from(
        [info("d", "decode", "A"), info("p1", "prefill", "B"), info("p2", "prefill", "C")]
    )
    r = await route(pools)
    assert r.prefill is None and r.decode.url == url("d"), r
    assert "KV layout" in r.reason, r


async def test_decode_first_then_its_layout() -> None:
    # d-b is the least loaded D: its P is p-b (layout B), busier than p-a (layout A).
    pools = pools_from(
        [
            info("d-a", "decode", "A"),
            info("d-b", "decode", "B"),
            info("p-a", "prefill", "A"),
            info("p-b", "prefill", "B"),
        ]
    )
    load = busy(url("d-a"), url("p-b"))
    r = await route(pools, load)
    assert r.decode.url == url("d-b") and r.prefill is not None and r.prefill.url == url("p-b"), r
    # the matching P failed this request: prefill on D rather than on p-a
    r = await route(pools, load, exclude=(url("p-b"),))
    assert r.decode.url == url("d-b") and r.prefill is None, r


async def test_least_loaded_among_matching_and_inactive_or_other_models_ignored() -> None:
    pools = pools_from(
        [
            info("d", "decode", "A"),
            info("p1", "prefill", "A"),
            info("p2", "prefill", "A"),
            info("p3", "prefill", "A", status="draining"),
            info("x", "prefill", "A", model="other"),
        ]
    )
    assert pools[MODEL].prefill == (url("p1"), url("p2"))
    r = await route(pools, busy(url("p1")))
    assert r.prefill is not None and r.prefill.url == url("p2"), r


async def test_configured_list_without_hashes_pairs_as_before() -> None:
    pools = {MODEL: StaticNodes(prefill=("http://p1", "http://p2"), decode=("http://d",))}
    r = await route(pools, busy("http://p1"))
    assert r.decode.url == "http://d" and r.prefill is not None and r.prefill.url == "http://p2", r
    assert r.reason == "static: least-loaded pair"


async def test_colocated_when_no_decode_node_and_503_when_none() -> None:
    pools = pools_from([info("b", "both", "A"), info("p", "prefill", "B")])
    r = await route(pools)
    assert r.prefill is None and r.decode.url == url("b"), r
    with pytest.raises(APIError) as e:
        await route(pools, exclude=(url("b"),))
    assert e.value.status == 503


def test_the_rule() -> None:
    assert kv_layouts_match("A", "A") and not kv_layouts_match("A", "B")
    assert (
        kv_layouts_match(None, "A") and kv_layouts_match("A", None) and kv_layouts_match(None, None)
    )
