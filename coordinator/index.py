"""The global prefix index: block hash → the nodes holding that block, with a memory bound.

Each node gets a bit; an entry maps a block hash to the bitmask of nodes that hold it, so a
match walks the request's hashes once with one AND per block and stops as soon as no candidate
node is left. `match` answers, per node, how many *leading* blocks of the request it holds
(block hashes are chained, so a hit after a miss cannot be reused and is not counted).

Memory bound: at most `max_blocks` entries (distinct hashes). Entries are kept in LRU order:
storing or matching a chain makes its hashes most recent, the chain's first block last (so a
shared prefix outlives the tails hanging off it); past the bound the least recently used entry
is dropped for every node (the index then under-estimates that node's cache, never over-).

Tiers: a node holds each block in one place, its KV pool or a spill tier ("host", "disk");
the masks say a node holds a block somewhere, and `_spilled[b]` says which of node `b`'s blocks
are in a tier, so `match` counts a prefix held anywhere and `tiers` tells how much of a node's
match has to be loaded back first (the router prices that load against recomputing).

Invariants: `_masks[h]` is non-zero and bit `b` is set iff hash `h` is in `_held[b]`;
`_spilled[b]` ⊆ `_held[b]`; a node removed with `remove_node` leaves no bit behind and its bit
is reused only after that.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_blocks: int = 1_000_000) -> None:
        if max_blocks < 1:
            raise ValueError("the prefix index needs room for at least one block")
        self.max_blocks = max_blocks
        self._masks: OrderedDict[int, int] = OrderedDict()
        self._bit: dict[str, int] = {}
        self._node_of_bit: dict[int, str] = {}
        self._held: dict[int, set[int]] = {}
        #: per node bit: its blocks held in a spill tier, hash → medium
        self._spilled: dict[int, dict[int, str]] = {}
        self._free_bits: list[int] = []
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._masks)

    @property
    def nodes(self) -> list[str]:
        return list(self._bit)

    def node_block_count(self, node: str) -> int:
        b = self._bit.get(node)
        return 0 if b is None else len(self._held[b])

    def node_blocks(self, node: str) -> set[int]:
        b = self._bit.get(node)
        return set() if b is None else set(self._held[b])

    def _bit_of(self, node: str) -> int:
        b = self._bit.get(node)
        if b is None:
            b = self._free_bits.pop() if self._free_bits else len(self._bit)
            self._bit[node] = b
            self._node_of_bit[b] = node
            self._held[b] = set()
            self._spilled[b] = {}
        return b

    def node_tier_count(self, node: str, medium: str) -> int:
        b = self._bit.get(node)
        return 0 if b is None else sum(1 for m in self._spilled[b].values() if m == medium)

    # -- updates ---------------------------------------------------------------------------
    def store(self, node: str, hashes: Iterable[int], medium: str | None = None) -> None:
        """The node now holds `hashes` in its pool (`medium` None) or in that spill tier."""
        b = self._bit_of(node)
        m = 1 << b
        hashes = list(hashes)
        spilled = self._spilled[b]
        for h in hashes:
            if medium is None:
                spilled.pop(h, None)
            else:
                spilled[h] = medium
        held, masks = self._held[b], self._masks
        # Reversed, so a chain's first blocks end up most recent and a tail is evicted first.
        for h in reversed(hashes):
            old = masks.get(h)
            if old is None:
                masks[h] = m
                if len(masks) > self.max_blocks:
                    self._evict_one()
            else:
                masks[h] = old | m
                masks.move_to_end(h)
            held.add(h)

    def _evict_one(self) -> None:
        h, mask = self._masks.popitem(last=False)
        self.evictions += 1
        while mask:
            low = mask & -mask
            self._held[low.bit_length() - 1].discard(h)
            self._spilled[low.bit_length() - 1].pop(h, None)
            mask ^= low

    def remove(self, node: str, hashes: Iterable[int]) -> None:
        b = self._bit.get(node)
        if b is None:
            return
        clear, held, masks, spilled = ~(1 << b), self._held[b], self._masks, self._spilled[b]
        for h in hashes:
            if h in held:
                held.discard(h)
                spilled.pop(h, None)
                m = masks[h] & clear
                if m:
                    masks[h] = m
                else:
                    del masks[h]

    def clear_node(self, node: str) -> None:
        """Forget every block of `node` (AllBlocksCleared, or before a snapshot)."""
        b = self._bit.get(node)
        if b is not None:
            self.remove(node, list(self._held[b]))

    def replace_node(
        self,
        node: str,
        hashes: Iterable[int],
        tiered: Iterable[tuple[str, Iterable[int]]] = (),
    ) -> None:
        """The node's whole cache is exactly `hashes` in its pool and each (medium, hashes) of
        `tiered` in that tier (a snapshot)."""
        self.clear_node(node)
        for medium, spilled in tiered:
            self.store(node, spilled, medium)
        self.store(node, hashes)

    def remove_node(self, node: str) -> None:
        """The node left the cluster: drop all its blocks and free its bit."""
        b = self._bit.get(node)
        if b is None:
            return
        self.clear_node(node)
        del self._bit[node], self._node_of_bit[b], self._held[b], self._spilled[b]
        self._free_bits.append(b)

    # -- queries ---------------------------------------------------------------------------
    def match(self, hashes: Sequence[int], nodes: Iterable[str] | None = None) -> dict[str, int]:
        """{node: number of leading blocks of `hashes` it holds} for `nodes` (default: all),
        leaving out nodes with none. Matched entries become most recently used."""
        if nodes is None:
            active = 0
            for b in self._node_of_bit:
                active |= 1 << b
        else:
            active = 0
            for n in nodes:
                bit = self._bit.get(n)
                if bit is not None:
                    active |= 1 << bit
        out: dict[str, int] = {}
        get = self._masks.get
        node_of_bit = self._node_of_bit
        i = 0
        for i, h in enumerate(hashes):
            new = active & get(h, 0)
            if new != active:
                dropped = active & ~new
                while dropped:
                    low = dropped & -dropped
                    if i:
                        out[node_of_bit[low.bit_length() - 1]] = i
                    dropped ^= low
                active = new
                if not active:
                    break
        else:
            i = len(hashes)
        while active and i:
            low = active & -active
            out[node_of_bit[low.bit_length() - 1]] = i
            active ^= low
        # The matched prefix becomes most recently used, its first block last (evicted last).
        touch = self._masks.move_to_end
        for h in reversed(hashes[: max(out.values(), default=0)]):
            touch(h)
        return out

    def tiers(self, node: str, hashes: Sequence[int], n: int) -> dict[str, int]:
        """{medium: blocks} of the first `n` of `hashes` that `node` holds in a spill tier
        (empty when all are in its pool)."""
        b = self._bit.get(node)
        spilled = self._spilled.get(b, {}) if b is not None else {}
        out: dict[str, int] = {}
        if spilled:
            for h in hashes[:n]:
                medium = spilled.get(h)
                if medium is not None:
                    out[medium] = out.get(medium, 0) + 1
        return out
