"""The routing policy on hand-built cluster views (pure, exact): conditional disaggregation,
prefix affinity, admission, tiers, draining, pending decisions against herding, and errors."""

from __future__ import annotations

import pytest

from coordinator.index import PrefixIndex
from coordinator.nodes import NodeView
from coordinator.policy import Router
from coordinator.route_config import PolicyConfig
from protocol.cluster import NodeInfo
from protocol.kv_events import LoadFrame
from protocol.openai import APIError
from protocol.route import RouteRequest

NOW = 1000.0


def view(
    node_id: str,
    role: str,
    *,
    pool: str = "shared",
    status: str = "active",
    free: int = 1000,
    total: int = 1000,
    running: int = 0,
    waiting: int = 0,
    queued: int = 0,
    layout: str = "L",
    model: str = "m",
    max_len: int = 4096,
    load_at: float = NOW,
) -> NodeView:
    info = NodeInfo(
        node_id=node_id,
        role=role,
        url=f"http://{node_id}:1",
        model=model,
        engine_id=f"{node_id}-e",
        block_size=16,
        kv_layout_hash=layout,
        kv_capacity_blocks=total,
        max_model_len=max_len,
        pool=pool,
        status=status,
        started_at=0.0,
    )  # type: ignore[arg-type]
    v = NodeView(info=info, connected=True, load_at=load_at)
    v.load = LoadFrame(
        seq=0,
        ts=0.0,
        num_requests_waiting=waiting,
        num_requests_running=running,
        kv_cache_usage_perc=(total - free) / total,
        queued_prefill_tokens=queued,
        kv_blocks_free=free,
        kv_blocks_total=total,
    )
    return v


def req(n_tokens: int, hashes: list[int] | None = None, **kw) -> RouteRequest:
    return RouteRequest(
        model=kw.pop("model", "m"),
        block_hashes=hashes or [],
        num_prompt_tokens=n_tokens,
        max_tokens=kw.pop("max_tokens", 16),
        **kw,
    )


def route(views: list[NodeView], r: RouteRequest, index: PrefixIndex | None = None, **cfg):
    return Router(PolicyConfig(**cfg)).route(r, views, index or PrefixIndex(), NOW)


def test_short_prompt_prefills_locally() -> None:
    d = route([view("p1", "prefill"), view("d1", "decode")], req(100))
    assert d.response.prefill is None and d.response.decode.node_id == "d1"
    assert d.outcome == "local_short" and "local_prefill_tokens 256" in d.response.reason


def test_long_prompt_is_disaggregated_to_the_p_holding_its_prefix() -> None:
    index = PrefixIndex()
    hashes = list(range(40))
    index.store("p2", hashes[:32])  # p2 holds a 512-token prefix
    d = route(
        [view("p1", "prefill"), view("p2", "prefill"), view("d1", "decode")],
        req(640, hashes),
        index,
    )
    assert d.outcome == "disaggregated"
    assert d.response.prefill is not None and d.response.prefill.node_id == "p2"
    assert d.response.prefill.cached_tokens == 512 and d.response.decode.cached_tokens == 0


def test_fully_cached_prompt_on_d_prefills_locally() -> None:
    index = PrefixIndex()
    hashes = list(range(40))
    index.store("d1", hashes)
    d = route(
        [view("p1", "prefill"), view("d1", "decode"), view("d2", "decode")], req(640, hashes), index
    )
    assert d.response.prefill is None and d.response.decode.node_id == "d1"
    assert (
        d.outcome == "local_cached" and d.response.decode.cached_tokens == 639
    )  # last token computed


def test_saturated_prefill_pool_prefills_on_d() -> None:
    views = [view("p1", "prefill", queued=10_000), view("d1", "decode")]
    d = route(views, req(1000))
    assert d.response.prefill is None and d.outcome == "local_p_saturated"


def test_decode_admission_needs_free_blocks() -> None:
    views = [view("d1", "decode", free=10), view("d2", "decode", free=200, running=20)]
    d = route(views, req(1000, max_tokens=1000))  # 125 blocks
    assert d.response.decode.node_id == "d2"
    with pytest.raises(APIError) as e:
        route([view("d1", "decode", free=10)], req(1000, max_tokens=1000))
    assert (
        e.value.status == 503
        and e.value.code == "no_capacity"
        and "d1 (10 free blocks < 125)" in e.value.message
    )


def test_decode_is_chosen_by_its_load() -> None:
    views = [view("d1", "decode", running=8, free=500), view("d2", "decode", running=2, free=900)]
    assert route(views, req(100)).response.decode.node_id == "d2"


def test_draining_excluded_and_stale_nodes_get_nothing() -> None:
    views = [
        view("d1", "decode", status="draining"),
        view("d2", "decode", load_at=NOW - 60),
        view("d3", "decode"),
    ]
    assert route(views, req(100)).response.decode.node_id == "d3"
    assert route(views, req(100, exclude=["d1"])).response.decode.node_id == "d3"
    with pytest.raises(APIError) as e:
        route(views, req(100, exclude=["d3"]))
    assert e.value.status == 503


def test_both_nodes_serve_either_role() -> None:
    # Only `both` nodes: a long prompt runs prefill on one and decode on another, or locally.
    d = route([view("b1", "both", running=5), view("b2", "both")], req(1000))
    assert d.response.decode.node_id == "b2"
    assert d.response.prefill is None and d.outcome == "local_prefill_is_d"
    d = route([view("b1", "both", running=5), view("b2", "both", queued=5000)], req(1000))
    assert d.response.prefill is not None and d.response.prefill.node_id == "b1"
    assert d.response.decode.node_id == "b2"


def test_tiers_prefer_their_pool_then_shared() -> None:
    views = [
        view("d-int", "decode", pool="interactive"),
        view("d-batch", "decode", pool="batch"),
        view("d-shared", "decode", pool="shared", running=0),
    ]
    assert route(views, req(100, tier="batch")).response.decode.node_id == "d-batch"
    assert route(views, req(100, tier="interactive")).response.decode.node_id == "d-int"
    no_int = [v for v in views if v.node_id != "d-int"]
    assert route(no_int, req(100, tier="interactive")).response.decode.node_id == "d-shared"


def test_pending_decisions_spread_a_burst() -> None:
    views = [view("d1", "decode"), view("d2", "decode"), view("d3", "decode")]
    router, index = Router(PolicyConfig()), PrefixIndex()
    chosen = []
    for _ in range(6):  # no load report arrives in between
        dec = router.route(req(100), views, index, NOW)
        for node_id, (seqs, tokens, blocks) in dec.pending.items():
            next(v for v in views if v.node_id == node_id).add_pending(NOW, seqs, tokens, blocks)
        chosen.append(dec.response.decode.node_id)
    assert sorted(chosen) == ["d1", "d1", "d2", "d2", "d3", "d3"]


def test_prefill_and_decode_layouts_must_match() -> None:
    d = route([view("p1", "prefill", layout="X"), view("d1", "decode", layout="Y")], req(1000))
    assert d.response.prefill is None and d.outcome == "local_no_prefill"


@pytest.mark.parametrize(
    "r, status, text",
    [
        (req(100, model="other"), 404, "no node serves model 'other'"),
        (req(4000, max_tokens=200), 400, "exceeds the context"),
        (req(0), 400, "num_prompt_tokens"),
        (req(100, max_tokens=0), 400, "max_tokens"),
        (req(20, [1, 2]), 400, "do not fit"),
        (req(100, [-1]), 400, "unsigned 64-bit"),
        (req(100, [2**64]), 400, "unsigned 64-bit"),
    ],
)
def test_bad_requests(r: RouteRequest, status: int, text: str) -> None:
    with pytest.raises(APIError) as e:
        route([view("d1", "decode")], r)
    assert e.value.status == status and text in e.value.message
