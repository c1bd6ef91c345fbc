"""The routing policy and the KV hierarchy (coordinator/kv_reuse.py), on hand-built views:
memory beats host beats disk beats recompute, a node pulls from the node holding the longest
prefix when that is cheaper than computing (`kv_source`), another domain's prefix is never a
source, and each decision says what reuse existed and what the route captured."""

from __future__ import annotations

from coordinator.index import PrefixIndex
from coordinator.kv_reuse import KVCosts
from protocol.block_hash import block_hashes, domain_root
from protocol.route import KVSource
from tests.coordinator.test_policy import req, route, view

HASHES = list(range(1, 41))  # a 640-token prompt


def test_the_pool_beats_the_host_beats_disk_beats_recompute() -> None:
    index = PrefixIndex()
    index.store("p-pool", HASHES[:32])
    index.store("p-host", HASHES[:32], "host")
    index.store("p-disk", HASHES[:32], "disk")
    ps = [view(n, "prefill") for n in ("p-disk", "p-host", "p-none", "p-pool")]
    d = view("d1", "decode")
    pick = route([*ps, d], req(640, HASHES), index)
    assert pick.response.prefill is not None and pick.response.prefill.node_id == "p-pool"
    assert pick.response.kv_source is None
    order = []
    for gone in ("p-pool", "p-host", "p-disk"):
        pick = route([*ps, d], req(640, HASHES, exclude=order + [gone]), index)
        assert pick.response.prefill is not None
        order.append(gone)
        assert (
            pick.response.prefill.node_id
            == {
                "p-pool": "p-host",
                "p-host": "p-disk",
                "p-disk": "p-none",
            }[gone]
        )


def test_a_prefill_node_pulls_the_prefix_a_decode_node_holds() -> None:
    """The next turn of a conversation: its decode node holds the history, too little of the
    prompt to prefill there; the prefill node pulls the history from it."""
    index = PrefixIndex()
    index.store("d1", HASHES[:20])  # 320 of 640 tokens: 320 uncached > 256, so a P computes
    pick = route([view("p1", "prefill"), view("d1", "decode")], req(640, HASHES), index)
    assert pick.outcome == "disaggregated"
    assert pick.response.prefill is not None and pick.response.prefill.node_id == "p1"
    assert pick.response.kv_source == KVSource(
        node_id="d1", url="http://d1:1", num_blocks=20, from_block=0
    )
    assert "pulled from d1" in pick.response.reason
    assert pick.reuse is not None
    assert pick.reuse.existed == 320 and pick.reuse.captured == {"pool": 0, "peer": 320}
    # the pull is accounted on P: its pending prefill work is what it computes
    assert pick.pending["p1"][1] == 320


def test_a_pull_starts_after_what_the_node_holds_and_needs_a_real_gain() -> None:
    index = PrefixIndex()
    index.store("p1", HASHES[:10])
    index.store("d1", HASHES[:30], "host")
    # (160 tokens uncached on d1: under the default threshold it would prefill itself)
    nodes = [view("p1", "prefill"), view("d1", "decode")]
    pick = route(nodes, req(640, HASHES), index, local_prefill_tokens=64)
    src = pick.response.kv_source
    assert src is not None and (src.num_blocks, src.from_block) == (30, 10)
    assert pick.reuse is not None and pick.reuse.captured == {"pool": 160, "peer": 320}
    # a source one block ahead is not worth a pull (peer_min_blocks 2)
    index2 = PrefixIndex()
    index2.store("p1", HASHES[:10])
    index2.store("d1", HASHES[:11])
    pick = route([view("p1", "prefill"), view("d1", "decode")], req(640, HASHES), index2)
    assert pick.response.kv_source is None


def test_no_source_when_pulls_are_off_or_the_layout_differs() -> None:
    index = PrefixIndex()
    index.store("d1", HASHES[:20])
    nodes = [view("p1", "prefill"), view("d1", "decode")]
    off = route(nodes, req(640, HASHES), index, kv=KVCosts(enable_peer_pull=False))
    assert off.response.kv_source is None and off.reuse is not None
    assert off.reuse.existed == 320 and off.reuse.captured == {"pool": 0, "peer": 0}
    other = [view("p1", "prefill", layout="L2"), view("p2", "prefill"), view("d1", "decode")]
    pick = route(other, req(640, HASHES), index)
    # p1 cannot read d1's blocks; p2 can, and pulls
    assert pick.response.prefill is not None and pick.response.prefill.node_id == "p2"
    assert pick.response.kv_source is not None and pick.response.kv_source.node_id == "d1"


def test_another_domains_prefix_is_never_a_source() -> None:
    prompt = list(range(500, 1140))
    team_a = block_hashes(prompt, 16, parent=domain_root("team:a"))
    team_b = block_hashes(prompt, 16, parent=domain_root("team:b"))
    index = PrefixIndex()
    index.store("d1", team_a)  # team a's conversation, whole
    pick = route([view("p1", "prefill"), view("d1", "decode")], req(640, team_b), index)
    assert pick.response.kv_source is None
    assert pick.reuse is not None and pick.reuse.existed == 0
    same = route([view("p1", "prefill"), view("d1", "decode")], req(640, team_a), index)
    assert same.reuse is not None and same.reuse.existed == 639


def test_reuse_that_existed_includes_nodes_the_route_could_not_use() -> None:
    index = PrefixIndex()
    index.store("p2", HASHES[:32])
    pick = route(
        [view("p1", "prefill"), view("p2", "prefill"), view("d1", "decode")],
        req(640, HASHES, exclude=["p2"]),
        index,
    )
    assert pick.reuse is not None
    assert pick.reuse.existed == 512 and pick.reuse.captured == {"pool": 0, "peer": 0}
