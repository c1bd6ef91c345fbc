"""The routing policy's task filter (protocol.cluster.NodeTask): embedding requests go only to
embed nodes — the least loaded by queued prompt tokens, pending decisions included — and
generation requests never do, even for the same model."""

from __future__ import annotations

import msgspec
import pytest

from coordinator.index import PrefixIndex
from coordinator.nodes import NodeView
from coordinator.policy import Router
from coordinator.route_config import PolicyConfig
from protocol.cluster import NodeInfo, NodeTask
from protocol.openai import APIError
from protocol.route import RouteRequest
from tests.coordinator.test_policy import NOW, view


def embed_view(node_id: str, **kw) -> NodeView:
    v = view(node_id, "both", **kw)
    v.info = msgspec.structs.replace(v.info, task=NodeTask.EMBED)
    return v


def embed_req(n: int, **kw) -> RouteRequest:
    return RouteRequest(
        model="m", block_hashes=[], num_prompt_tokens=n, max_tokens=1, task=NodeTask.EMBED, **kw
    )


def test_embed_goes_to_the_least_loaded_embed_node_only() -> None:
    router = Router(PolicyConfig())
    nodes = [view("g1", "both"), embed_view("e1", queued=500), embed_view("e2", queued=100)]
    d = router.route(embed_req(50), nodes, PrefixIndex(), NOW)
    assert d.response.decode.node_id == "e2" and d.response.prefill is None and d.outcome == "embed"
    assert d.pending == {"e2": (0, 50, 0)}
    # the pending decision counts against e2 until its load frames show the work
    nodes[2].add_pending(NOW, 0, 600, 0)
    assert router.route(embed_req(50), nodes, PrefixIndex(), NOW).response.decode.node_id == "e1"


def test_generation_never_reaches_an_embed_node() -> None:
    router = Router(PolicyConfig())
    nodes = [embed_view("e1"), view("g1", "both", queued=10_000, running=50)]
    for _ in range(3):
        assert (
            router.route(
                RouteRequest(model="m", block_hashes=[], num_prompt_tokens=10, max_tokens=4),
                nodes,
                PrefixIndex(),
                NOW,
            ).response.decode.node_id
            == "g1"
        )
    with pytest.raises(APIError) as e:  # only embed nodes serve the model: none generates
        router.route(
            RouteRequest(model="m", block_hashes=[], num_prompt_tokens=10, max_tokens=4),
            [embed_view("e1")],
            PrefixIndex(),
            NOW,
        )
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(APIError) as e:
        router.route(embed_req(10), [view("g1", "both")], PrefixIndex(), NOW)
    assert e.value.status == 404 and "embeddings" in e.value.message


def test_embed_context_needs_no_room_for_a_token() -> None:
    router = Router(PolicyConfig())
    assert router.route(embed_req(4096), [embed_view("e1", max_len=4096)], PrefixIndex(), NOW)
    with pytest.raises(APIError) as e:
        router.route(embed_req(4097), [embed_view("e1", max_len=4096)], PrefixIndex(), NOW)
    assert e.value.code == "context_length_exceeded"


def test_old_records_decode_as_generation_nodes() -> None:
    raw = msgspec.json.encode(view("g1", "both").info)
    assert b"task" not in raw or msgspec.json.decode(raw, type=NodeInfo).task == NodeTask.GENERATE
    assert (
        msgspec.json.decode(raw.replace(b',"task":"generate"', b""), type=NodeInfo).task
        == NodeTask.GENERATE
    )
