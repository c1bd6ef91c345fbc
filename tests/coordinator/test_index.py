"""The prefix index against a brute-force model (hypothesis): per-node leading matches, LRU
eviction under the memory bound, node removal."""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.index import PrefixIndex

NODES = ["a", "b", "c", "d"]
hashes = st.lists(st.integers(0, 24), max_size=12)
nodes = st.sampled_from(NODES)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), nodes, hashes),
        st.tuples(st.just("remove"), nodes, hashes),
        st.tuples(st.just("clear"), nodes),
        st.tuples(st.just("remove_node"), nodes),
        st.tuples(st.just("match"), hashes, st.one_of(st.none(), st.lists(nodes, unique=True))),
    ),
    max_size=60,
)


class Model:
    """The obvious implementation: an LRU-ordered dict of hash → set of nodes."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.entries: OrderedDict[int, set[str]] = OrderedDict()

    def store(self, node: str, hs: list[int]) -> None:
        for h in reversed(hs):  # a chain's first block ends up most recent
            if h in self.entries:
                self.entries[h].add(node)
                self.entries.move_to_end(h)
            else:
                self.entries[h] = {node}
                if len(self.entries) > self.max_blocks:
                    self.entries.popitem(last=False)

    def remove(self, node: str, hs: list[int]) -> None:
        for h in hs:
            if h in self.entries:
                self.entries[h].discard(node)
                if not self.entries[h]:
                    del self.entries[h]

    def clear(self, node: str) -> None:
        self.remove(node, list(self.entries))

    def match(self, hs: list[int], candidates: list[str] | None) -> dict[str, int]:
        cands = set(NODES if candidates is None else candidates)
        out: dict[str, int] = {}
        for n in cands:
            k = 0
            while k < len(hs) and n in self.entries.get(hs[k], set()):
                k += 1
            if k:
                out[n] = k
        for h in reversed(
            hs[: max(out.values(), default=0)]
        ):  # the matched prefix, first block last
            self.entries.move_to_end(h)
        return out

    def blocks(self, node: str) -> set[int]:
        return {h for h, ns in self.entries.items() if node in ns}


@settings(max_examples=300, deadline=None)
@given(max_blocks=st.integers(1, 12), ops=ops)
def test_index_matches_brute_force_model(max_blocks: int, ops: list[tuple]) -> None:
    index, model = PrefixIndex(max_blocks), Model(max_blocks)
    for op in ops:
        kind = op[0]
        if kind == "store":
            index.store(op[1], op[2])
            model.store(op[1], op[2])
        elif kind == "remove":
            index.remove(op[1], op[2])
            model.remove(op[1], op[2])
        elif kind in ("clear", "remove_node"):
            getattr(index, "clear_node" if kind == "clear" else "remove_node")(op[1])
            model.clear(op[1])
        else:
            assert index.match(op[1], op[2]) == model.match(op[1], op[2])
        assert len(index) == len(model.entries) <= max_blocks
        assert list(index._masks) == list(model.entries)  # same LRU order, so same evictions
        for n in NODES:
            assert index.node_blocks(n) == model.blocks(n)


def test_leading_blocks_only_and_removal() -> None:
    index = PrefixIndex()
    index.store("p1", [1, 2, 3, 4])
    index.store("p2", [1, 2])
    index.store("p3", [2, 3, 4])  # holds later blocks without the first: not reusable
    assert index.match([1, 2, 3, 4, 5]) == {"p1": 4, "p2": 2}
    assert index.match([1, 2, 3], ["p2", "p3"]) == {"p2": 2}
    index.remove_node("p1")
    assert index.match([1, 2, 3, 4]) == {"p2": 2}
    assert index.node_blocks("p1") == set()
    index.store("p4", [1])  # reuses p1's bit; nothing of p1 leaks into p4
    assert index.match([1, 2, 3]) == {"p2": 2, "p4": 1}


def test_memory_bound_evicts_least_recently_matched() -> None:
    index = PrefixIndex(max_blocks=4)
    index.store("a", [10, 11, 12])  # LRU order: 12, 11, 10 (the chain's root is the most recent)
    index.store("b", [20, 21])  # over the bound: the tail block 12 goes, the prefix stays
    assert len(index) == 4 and index.evictions == 1
    assert index.match([10, 11, 12]) == {"a": 2}
    index.store("b", [22])  # next out: b's tail 21, not a's recently matched chain
    assert index.node_blocks("a") == {10, 11} and index.node_blocks("b") == {20, 22}


def test_tiers_say_where_a_nodes_match_is() -> None:
    idx = PrefixIndex()
    idx.store("a", [1, 2, 3, 4])
    idx.store("a", [3], "host")  # moved down: still held, now on the host tier
    idx.store("a", [4], "disk")
    idx.store("b", [1, 2])
    assert idx.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert idx.tiers("a", [1, 2, 3, 4, 5], 4) == {"host": 1, "disk": 1}
    assert idx.tiers("a", [1, 2, 3, 4, 5], 2) == {} and idx.tiers("b", [1, 2], 2) == {}
    idx.store("a", [3])  # loaded back into the pool
    assert idx.tiers("a", [1, 2, 3, 4], 4) == {"disk": 1}
    idx.remove("a", [4])  # gone from the node, whichever tier it was in
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 2} and idx.node_tier_count("a", "disk") == 0
    idx.replace_node("a", [1], [("host", [2]), ("disk", [3])])
    assert idx.match([1, 2, 3]) == {"a": 3, "b": 2}
    assert idx.tiers("a", [1, 2, 3], 3) == {"host": 1, "disk": 1}
    idx.remove_node("a")
    assert idx.tiers("a", [1, 2, 3], 3) == {}


def test_evicting_an_entry_forgets_its_tier() -> None:
    idx = PrefixIndex(max_blocks=2)
    idx.store("a", [1], "host")
    idx.store("a", [2])
    idx.store("a", [3])  # 1 is the least recently used: dropped for every node
    assert idx.node_tier_count("a", "host") == 0 and idx.node_blocks("a") == {2, 3}
