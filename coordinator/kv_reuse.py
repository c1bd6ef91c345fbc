"""What reusing a request's prefix costs on each node, wherever the KV sits (DESIGN §9).

For every usable node the router asks: how many of the prompt's tokens need not be computed
there, and what does getting their KV cost? A node holds a prefix's blocks in its KV pool (free
to use), in its host or disk spill tier (loaded back first), or not at all; another node may
hold more of it, and then the node can pull those blocks from it (`kv_source` in the route)
before computing the rest. Costs are token-equivalents, the unit of the router's other costs:
computing one prompt token costs `prefill_token`; loading a token's KV back from host memory
or disk, or pulling it from a peer, costs the weights of `KVCosts` (measured: see
`bench.kv_tiers`), and each pull adds a fixed cost for its round trips. A node takes a source
only when pulling costs less than computing.

Only one source is considered: the usable node holding the longest prefix (the pool before the
tiers on a tie, then the lower id), of the computing node's KV layout. Cache domains hold by
construction: the index's hashes are salted by the domain, so a node can only match, and
so be a source for, prefixes of the request's own domain.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from coordinator.index import PrefixIndex
from coordinator.nodes import NodeView
from protocol.cluster import kv_layouts_match


@dataclass(frozen=True)
class KVCosts:
    """Token-equivalent costs of reused KV (a prompt token computed costs the router's
    `prefill_token`, 1.0 by default). Defaults measured with SmolLM2-135M on a 2-core Zen 3
    (`python -m bench.kv_tiers`); rerun it on the fleet's hardware and set them here."""

    #: cost of a prompt token whose KV a node loads back from its host spill tier
    host_token: float = 0.01
    #: cost of a prompt token whose KV a node loads back from its disk spill tier
    disk_token: float = 0.03
    #: cost of a prompt token whose KV a node pulls from another node
    peer_token: float = 0.03
    #: cost of one pull on top of its tokens: the share request, the peer's handshake, the
    #: release
    peer_pull_cost: float = 16.0
    #: the node computing a prompt pulls its prefix from the node holding the longest one, when
    #: that costs less than computing it (off: a node reuses only the KV it holds itself)
    enable_peer_pull: bool = True
    #: name a source only when it holds at least this many more blocks than the node
    peer_min_blocks: int = 2


@dataclass(frozen=True)
class RouteReuse:
    """A decision's prompt tokens, and the reuse of their KV: the most any node serving the
    model held (per the index), and what the route captured on the node that computes the
    prompt, by where ("pool", "host", "disk", "peer")."""

    prompt_tokens: int
    existed: int
    captured: dict[str, int]


@dataclass(slots=True)
class Reuse:
    """One node's best way to get the request's prefix (the router's `_Facts.reuse`)."""

    #: prompt tokens the node need not compute (its own, or up to the source's)
    tokens: int
    #: token-equivalent cost of getting them (loading from its tiers, pulling)
    cost: float
    #: tokens it holds itself, by where: "pool", "host", "disk"
    own: dict[str, int] = field(default_factory=dict)
    #: the node to pull from, and the tokens the pull adds
    source: NodeView | None = None
    pulled: int = 0
    #: the source's leading blocks, and the node's own (where the pull starts)
    source_blocks: int = 0
    own_blocks: int = 0


def _split(
    index: PrefixIndex, node: str, hashes: Sequence[int], blocks: int, tokens: int, bs: int
) -> dict[str, int]:
    """The node's `tokens` of the prefix by where they are (its first `blocks` blocks)."""
    tiers = index.tiers(node, hashes, blocks)
    out = {m: min(n * bs, tokens) for m, n in tiers.items()}
    out["pool"] = max(0, tokens - sum(out.values()))
    return out


def _load_cost(costs: KVCosts, split: dict[str, int]) -> float:
    return costs.host_token * split.get("host", 0) + costs.disk_token * split.get("disk", 0)


def best_source(
    nodes: Iterable[NodeView], matches: dict[str, int], index: PrefixIndex, hashes: Sequence[int]
) -> NodeView | None:
    """The node holding the longest prefix; on a tie the one with fewer blocks in its tiers,
    then the lower id."""
    ranked = [
        (
            -matches[n.node_id],
            sum(index.tiers(n.node_id, hashes, matches[n.node_id]).values()),
            n.node_id,
            n,
        )
        for n in nodes
        if matches.get(n.node_id)
    ]
    return min(ranked, key=lambda t: t[:3])[3] if ranked else None


def reuse_for(
    node: NodeView,
    source: NodeView | None,
    matches: dict[str, int],
    index: PrefixIndex,
    hashes: Sequence[int],
    n_prompt: int,
    costs: KVCosts,
    prefill_token: float,
) -> Reuse:
    """`node`'s cheapest way to the prefix: what it holds, or pulled from `source`."""
    bs, own_blocks = node.info.block_size, matches.get(node.node_id, 0)
    own_tokens = min(own_blocks * bs, n_prompt - 1)
    split = _split(index, node.node_id, hashes, own_blocks, own_tokens, bs)
    best = Reuse(own_tokens, _load_cost(costs, split), split, own_blocks=own_blocks)
    if (
        source is None
        or not costs.enable_peer_pull
        or source is node
        or not kv_layouts_match(source.info.kv_layout_hash, node.info.kv_layout_hash)
    ):
        return best
    src_blocks = matches.get(source.node_id, 0)
    if src_blocks - own_blocks < costs.peer_min_blocks:
        return best
    src_tokens = min(src_blocks * bs, n_prompt - 1)
    pulled = src_tokens - own_tokens
    # the source loads its own spilled blocks of the range before it can share them
    rest = index.tiers(source.node_id, hashes[own_blocks:], src_blocks - own_blocks)
    src_load = (
        costs.host_token * rest.get("host", 0) * bs + costs.disk_token * rest.get("disk", 0) * bs
    )
    cost = best.cost + costs.peer_pull_cost + costs.peer_token * pulled + src_load
    if cost + prefill_token * (n_prompt - src_tokens) >= best.cost + prefill_token * (
        n_prompt - own_tokens
    ):
        return best
    return Reuse(src_tokens, cost, split, source, pulled, src_blocks, own_blocks)
