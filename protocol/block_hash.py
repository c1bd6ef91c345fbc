"""Chained prefix-block hashes (DESIGN.md §4).

    h_i = xxh3_64(seed, h_{i-1} as little-endian u64 ‖ tokens_i as little-endian u32)

over the *full* blocks of `block_size` tokens; a trailing partial block has no hash. The
gateway, the coordinator and every node compute the same values with this one function, so a
hash names the same prefix everywhere. Never use Python's `hash()`: it is salted per process.

Cache domains (DESIGN §8): the chain starts from `h_{-1} = domain_root(domain)`, so the same
tokens hash differently in two domains and no prefix cache or index ever matches across them
(a team cannot learn from `cached_tokens` what another team sent). The domain travels to the
nodes as vLLM's `cache_salt`; no domain (None or "") is the unsalted root, for requests sent to a
node by hand.

LoRA adapters: KV computed with an adapter is not the base model's, so an adapter is part of the
root too: `domain_root(domain, seed, adapter)` = xxh3_64(seed, root of the domain as little-endian
u64 ‖ b"lora:" ‖ the adapter's name as UTF-8). The base model (adapter None or "") keeps the
domain's root unchanged. Gateways, the coordinator's index and the nodes all hash an adapter's
requests this way, so its blocks are cached and matched per adapter (and per domain).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

#: Seed for every block hash in a cluster. Changing it invalidates every prefix index.
DEFAULT_HASH_SEED = 0x64756574  # "duet"
#: h_{-1}: the parent hash of a prompt's first block.
ROOT_PARENT_HASH = 0x9E3779B97F4A7C15
DEFAULT_BLOCK_SIZE = 16

_U64 = struct.Struct("<Q")


def domain_root(
    domain: str | None, seed: int = DEFAULT_HASH_SEED, adapter: str | None = None
) -> int:
    """h_{-1} of a cache domain: `xxh3_64(seed, domain as UTF-8)`, ROOT_PARENT_HASH for none;
    with a LoRA `adapter`, that root mixed with the adapter's name (see the module docstring)."""
    root = ROOT_PARENT_HASH if not domain else xxhash.xxh3_64_intdigest(domain.encode(), seed=seed)
    if not adapter:
        return root
    return xxhash.xxh3_64_intdigest(_U64.pack(root) + b"lora:" + adapter.encode(), seed=seed)


def hash_block(parent: int, tokens: Sequence[int], seed: int = DEFAULT_HASH_SEED) -> int:
    """Hash one full block given its parent's hash."""
    data = _U64.pack(parent) + struct.pack(f"<{len(tokens)}I", *tokens)
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = DEFAULT_HASH_SEED,
    parent: int = ROOT_PARENT_HASH,
) -> list[int]:
    """Hashes of every full block of `token_ids`, in order (len == len(token_ids) // block_size);
    `parent` is the chain's root: `domain_root(domain)` for a cache domain."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], seed)
        out.append(parent)
    return out
